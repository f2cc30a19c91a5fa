"""What the speed benchmarks time: our model at configs/multi30k.py's size or the paper's base size
(configs/default.py), with a variant's config overrides, on random batches.

`import_ours` can take the model and steps from another checkout, to time an earlier commit.
"""

import importlib
import os
import sys
import types

import jax
import numpy as np
from absl import flags
from flax import jax_utils
from ml_collections import config_flags

from transformer import config as config_lib
from transformer import decode, model

CONFIG_FILES = {'multi30k': 'multi30k.py', 'base': 'default.py'}  # in configs/


def load_config(variant: str, size: str = 'multi30k', checkout: str = ''):
  """The config of `size` from the configs/ of `checkout` (default: this one), with the variant's
  space-separated key=value overrides, parsed as train.py parses its --config.key=value."""
  root = checkout or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  argv = ['benchmark', f'--config={os.path.join(root, "configs", CONFIG_FILES[size])}',
          *(f'--config.{o}' for o in variant.split())]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  try:
    config_lib.parse_flags(argv, flag_values)
  except (config_lib.ConfigError, flags.Error) as error:
    raise SystemExit(f'--variant={variant!r}: {error}') from None
  return flag_values.config


def import_ours(checkout: str) -> types.SimpleNamespace:
  """configs.multi30k and transformer's config, decode and train_step: this checkout's, or those
  of `checkout`, imported in their place."""
  if checkout:
    for name in [n for n in sys.modules if n.split('.')[0] in ('configs', 'transformer')]:
      del sys.modules[name]  # modules imported before this (measure, ...) keep their own
    sys.path.insert(0, os.path.abspath(checkout))
  return types.SimpleNamespace(**{
      name.split('.')[-1]: importlib.import_module(name)
      for name in ('configs.multi30k', 'transformer.config', 'transformer.decode',
                   'transformer.train_step')})


def random_batch(rng: np.random.Generator, rows: int, length: int, vocab_size: int) -> dict:
  """Sources and targets: random words, lengths uniform in [length/2, length], EOS, 0-padded."""
  batch = {}
  for side in ('sources', 'targets'):
    tokens = rng.integers(3, vocab_size, (rows, length), dtype=np.int32)
    lengths = rng.integers(length // 2, length + 1, rows)
    tokens[np.arange(rows), lengths - 1] = decode.EOS_ID
    batch[side] = np.where(np.arange(length) < lengths[:, None], tokens, 0).astype(np.int32)
  return batch


class Ours:
  """Our model and steps at configs/multi30k.py's size, or with another `config`."""

  def __init__(self, modules: types.SimpleNamespace, config=None):
    self.decode, train_step = modules.decode, modules.train_step
    self.config = config or modules.multi30k.get_config()
    modules.config.validate(self.config)
    self.model_config = modules.config.model_config(self.config)
    self.steps = train_step.StepFunctions(self.config, self.model_config)
    self.state = jax_utils.replicate(train_step.initial_state(self.config, self.model_config))
    self.p_train_step = jax.pmap(self.steps.train_step, train_step.AXIS, donate_argnums=(0,))
    self.parameters = model.parameters_per_token(jax_utils.unreplicate(self.state.params))

  def train(self, batch):
    self.state, metrics = self.p_train_step(self.state, batch)
    jax.block_until_ready(metrics)

  def beam_params(self):
    params = jax_utils.unreplicate(self.state.params)
    table = params['source_embedding']['embedding']
    return {**params, 'source_embedding': {'embedding': table.at[decode.EOS_ID].set(0.0)}}

  def beam_search(self, params, sources, beam_size: int, alpha: float, extra_length: int):
    tokens, _, steps = self.decode.beam_search(self.model_config, params, sources,
                                               beam_size=beam_size, alpha=alpha,
                                               extra_length=extra_length)
    return jax.block_until_ready(tokens), int(steps)


def parse_shape(text: str) -> tuple[int, int]:
  rows, length = text.split('x')
  return int(rows), int(length)
