"""Checks an experiment config (an ml_collections.ConfigDict from configs/) before anything runs.

`KEYS` is the table of every key: its check, what a resumed run may do with it, and the value a
config.json from before it reads as. A new key is one line there and one in configs/default.py.
`validate` raises one `ConfigError` naming the first bad key, its value and how to fix it;
`check_resume` compares a config with a run's stored one (stored_config.py reads those);
`model_config` turns a valid config into the model's `TransformerConfig`.
"""

import dataclasses
import json
import numbers
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_collections

from transformer import languages
from transformer.model import TransformerConfig

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}
# Datasets without a TFDS name; anything of the form 'name/config' is looked up in TFDS.
LOCAL_DATASETS = ('multi30k', 'synthetic', 'text')
SCHEDULES = ('paper', 'warmup_rsqrt')
BYTE_AND_SPECIAL_PIECES = 256 + 3  # every vocabulary holds these besides what it learns


class SettingError(ValueError):
  """Input that cannot work, where the fix may be one config key's value.

  The message is written for a config given on the command line: with `key` and `value`, it ends
  `pass --config.KEY=VALUE`. `for_run(path)` says the same for the config.json of a run at `path`,
  which eval.py and translate.py read and no flag sets.
  """

  def __init__(self, problem: str, key: str = '', value: str = '', example: bool = False):
    self.problem, self.key, self.value = problem, key, value
    self.example = 'e.g. ' if example else ''
    super().__init__(f'{problem}; pass {self.example}--config.{key}={value}' if value else problem)

  def for_run(self, path) -> str:
    """The message with its fix as an edit of the run's config.json at `path`, which it names
    where a key is at fault."""
    if self.value:
      return f'{self.problem}; set "{self.key}" to {self.example}{self.value} in {path}'
    return f'{path}: {self}' if self.key and str(path) not in str(self) else str(self)


class ConfigError(SettingError):
  """A config value that cannot work; the message names the key and the fix."""


def _fail(key: str, value, problem: str, fix: str = '', example: bool = False):
  raise ConfigError(f'config.{key}={value!r}: {problem}', key, fix, example)


def _get(config, key: str):
  """The value of a dotted `key` ('model.d_model') of a ConfigDict or a dict."""
  node = config
  for part in key.split('.'):
    if not hasattr(node, 'keys') or part not in node:
      raise ConfigError(f'config.{key} is missing: add it to the config file '
                        '(configs/default.py lists every key)', key)
    node = node[part]
  return node


def integer(minimum: int):
  """A check: an integer >= `minimum`."""
  def check(key, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
      _fail(key, value, f'must be an integer >= {minimum}', 'N')
  return check


def real(low: float, high: float, high_inclusive: bool = False):
  """A check: a number in [low, high) (or [low, high])."""
  def check(key, value):
    number = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if not number or not (low <= value and (value <= high if high_inclusive else value < high)):
      _fail(key, value, f'must be a number in [{low}, {high}{"]" if high_inclusive else ")"}')
  return check


def one_of(*choices):
  """A check: one of `choices`."""
  def check(key, value):
    if value not in choices:
      _fail(key, value, f'must be one of {", ".join(map(repr, choices))}')
  return check


def text(problem: str):
  """A check: a string; else `problem`, the line's end ('must be a path or empty')."""
  def check(key, value):
    if not isinstance(value, str):
      _fail(key, value, problem)
  return check


def _dataset(key, value):
  if not isinstance(value, str) or ('/' not in value and value not in LOCAL_DATASETS):
    _fail(key, value, f'unknown dataset; use one of {", ".join(LOCAL_DATASETS)} or a TFDS '
          "translation dataset such as 'wmt14_translate/de-en'")


def _tags(key, value):
  if not isinstance(value, str) or value and not all(
      re.fullmatch(r'<[^\s<>,]+>', tag) for tag in value.split(',')):
    _fail(key, value, "must be comma-separated tags such as '<BT>' (no spaces), or empty")


def _splits(key, value):
  if not isinstance(value, str) or value and not set(value.split(',')) <= {'validation', 'test'}:
    _fail(key, value, "must be 'validation', 'test', both ('validation,test') or empty (none)")


def _xla_flags(key, value):
  if not isinstance(value, str) or not all(re.fullmatch(r'--xla_\w+=\S+', flag)
                                           for flag in value.split()):
    _fail(key, value, "must be empty or space-separated '--xla_name=value' flags")


def _tfds_data_dir(key, value):
  text('must be a path or empty')(key, value)
  if '://' in value:
    _fail(key, value, "TFDS writes and reads its array_record files with local file calls; give a "
          "local directory, or mount the bucket (gcsfuse) and give the mount's path")


def _files(key, value):
  text('must be a path or empty')(key, value)
  if value and '{lang}' not in value:
    _fail(key, value, "must contain '{lang}', replaced by source_lang and target_lang, e.g. "
          "'data/train.{lang}.gz'")


MISSING = object()  # `Key.added` of a key every config.json holds


@dataclasses.dataclass(frozen=True)
class Key:
  """A config key.

  Attributes:
    check: what its value must be (`integer`, `real`, `one_of`, `text` or a function of its own,
      called with the key and the value).
    resume: what a resumed run may do with it: 'fixed', keep the stored value (it shapes the
      parameters, their meaning or the vocabulary); 'order', change it, with a warning (the run
      then sees other batches than an uninterrupted one would); 'free', change it (how the run
      computes, logs, evaluates or saves).
    added: the value that a config.json written before the key existed reads as, the behaviour
      from before it; MISSING where every config.json holds the key.
  """

  check: Callable
  resume: str = 'free'
  added: Any = MISSING


_BOOL, _PATH = one_of(True, False), text('must be a path or empty')
# Every key of a config (configs/default.py says what each does). Validation, resuming and the
# reading of a stored config.json all follow it.
KEYS = {
    # Data.
    'dataset': Key(_dataset, 'fixed'),
    'source_lang': Key(text('must be a language code'), 'fixed'),
    'target_lang': Key(text('must be a language code'), 'fixed'),
    'pairs': Key(text("must be comma-separated language pairs, e.g. 'en-de,en-fr', or empty"),
                 'fixed', added=''),
    'source_tags': Key(_tags, 'fixed', added=''),
    'manual_dir': Key(text('must be a directory path or empty'), 'order'),
    'vocab_size': Key(integer(1), 'fixed'),
    'vocab_model_type': Key(one_of('bpe', 'unigram'), 'fixed'),
    'max_length': Key(integer(1), 'order'),
    'tokens_per_batch': Key(integer(1), 'order'),
    'packing': Key(_BOOL, 'order'),
    'vocab_sample_size': Key(integer(1), 'order'),
    'tfds_data_dir': Key(_tfds_data_dir),
    'train_files': Key(_files, 'order'),
    'validation_files': Key(_files),
    'test_files': Key(_files),
    # Model: all fixed but the dtype its output projection computes in.
    'model.d_model': Key(integer(2), 'fixed'),
    'model.d_ff': Key(integer(1), 'fixed'),
    'model.num_heads': Key(integer(1), 'fixed'),
    'model.num_encoder_layers': Key(integer(1), 'fixed'),
    'model.num_decoder_layers': Key(integer(1), 'fixed'),
    'model.dropout_rate': Key(real(0.0, 1.0), 'fixed'),
    'model.attention_dropout_rate': Key(real(0.0, 1.0), 'fixed'),
    'model.relu_dropout_rate': Key(real(0.0, 1.0), 'fixed'),
    'model.share_embeddings': Key(_BOOL, 'fixed'),
    'model.tie_output_embedding': Key(_BOOL, 'fixed'),
    'model.positional_encoding': Key(one_of('sinusoidal', 'learned'), 'fixed'),
    'model.max_positions': Key(integer(1), 'fixed'),
    'model.layer_norm': Key(one_of('post', 'pre'), 'fixed'),
    'model.layer_norm_epsilon': Key(real(0.0, 1.0), 'fixed'),
    'model.activation': Key(one_of('relu', 'swish', 'gelu'), 'fixed', added='relu'),
    'model.attention_bias': Key(one_of(False, True), 'fixed', added=False),
    'model.output_bias': Key(one_of(False, True), 'fixed', added=False),
    'model.scale_embedding': Key(one_of(True, False), 'fixed', added=True),
    'model.dtype': Key(one_of(*DTYPES), 'fixed'),
    'model.param_dtype': Key(one_of(*DTYPES), 'fixed'),
    'model.output_projection_dtype': Key(one_of('', *DTYPES), added=''),
    # Optimisation.
    'label_smoothing': Key(real(0.0, 1.0)),
    'schedule': Key(one_of(*SCHEDULES)),
    'lr_scale': Key(real(0.0, float('inf'))),
    'peak_learning_rate': Key(real(0.0, float('inf'))),
    'cooldown_steps': Key(integer(0), added=0),
    'warmup_steps': Key(integer(1)),
    'adam_b1': Key(real(0.0, 1.0)),
    'adam_b2': Key(real(0.0, 1.0)),
    'adam_eps': Key(real(0.0, float('inf'))),
    'grad_clip_norm': Key(real(0.0, float('inf'))),
    'num_train_steps': Key(integer(1)),
    'grad_accum_steps': Key(integer(1), 'order'),
    'seed': Key(integer(0), 'order'),
    'init_from': Key(text('must be a Hugging Face Marian directory or empty'), added=''),
    # Logging, evaluation and checkpoints.
    'log_every_steps': Key(integer(0)),
    'eval_every_steps': Key(integer(0)),
    'bleu_every_steps': Key(integer(0)),
    'final_bleu_splits': Key(_splits, added='validation,test'),
    'checkpoint_every_steps': Key(integer(0)),
    'checkpoint_every_secs': Key(integer(0)),
    'keep_checkpoints': Key(integer(1)),
    'average_last': Key(integer(1)),
    'preemption_check_every_steps': Key(integer(1), added=10),
    # Decoding.
    'beam_size': Key(integer(1)),
    'alpha': Key(real(0.0, float('inf'))),
    'decode_extra_length': Key(integer(0)),
    'compound_split_languages': Key(
        text("must be comma-separated language codes, e.g. 'de', or empty"), added='de,en,fr'),
    # How it computes, not what (transformer/kernels/choice.py; '' or 0: by machine).
    'implementation.attention': Key(one_of('', 'xla', 'cudnn', 'pallas'), added=''),
    'implementation.attention_projection': Key(one_of('', 'matrix', 'heads'), added='heads'),
    'implementation.loss_chunk_tokens': Key(integer(0)),
    'implementation.loss_reduction': Key(one_of('', 'separate', 'online'), added='separate'),
    'implementation.dropout_rng': Key(one_of('hash', 'rbg', 'unsafe_rbg', 'threefry2x32')),
    'implementation.decode_batch_tokens': Key(integer(0), added=0),
    'compilation_cache_dir': Key(text('must be a directory or empty'), added=''),
    'xla_flags': Key(_xla_flags, added=''),
}
GROUPS = ('model', 'implementation')


def _check_relations(config: ml_collections.ConfigDict):
  """What the keys must be together."""
  d_model, num_heads = config.model.d_model, config.model.num_heads
  if d_model % 2:
    _fail('model.d_model', d_model, 'must be even (sine/cosine positional encoding pairs)')
  if d_model % num_heads:
    _fail('model.num_heads', num_heads,
          f'model.d_model={d_model} must be divisible by it (d_k = d_v = d_model / heads); '
          f'choose a divisor of {d_model}')
  if config.vocab_size <= BYTE_AND_SPECIAL_PIECES and not config.init_from:
    _fail('vocab_size', config.vocab_size, f'256 byte pieces and 3 special ids take '
          f'{BYTE_AND_SPECIAL_PIECES} of it, and the pieces learned from the text come on top; '
          'use at least a few hundred more')
  if config.source_lang == config.target_lang:
    _fail('target_lang', config.target_lang, 'must differ from config.source_lang')
  if config.dataset == 'multi30k':
    for key in ('source_lang', 'target_lang'):
      one_of(*languages.MULTI30K)(key, config[key])
  if problem := languages.problem(config):
    _fail(*problem)
  if config.dataset == 'text' and not config.train_files:
    _fail('train_files', '', "dataset='text' reads its training pairs from these files",
          "'data/train.{lang}.gz'", example=True)
  integer(config.max_length)('tokens_per_batch', config.tokens_per_batch)
  if config.cooldown_steps > config.num_train_steps:
    _fail('cooldown_steps', config.cooldown_steps, 'the cooldown is part of '
          f'config.num_train_steps={config.num_train_steps}: lower it or raise that')
  if config.average_last > config.keep_checkpoints:
    _fail('average_last', config.average_last, 'averaging needs that many checkpoints kept; '
          f'raise config.keep_checkpoints ({config.keep_checkpoints})')
  length = config.max_length + config.decode_extra_length
  if config.model.positional_encoding == 'learned' and config.model.max_positions < length:
    _fail('model.max_positions', config.model.max_positions,
          f'learned positions must cover max_length + decode_extra_length = {length}')


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Returns `config` unchanged if every key is usable (`KEYS`, then how they go together), else
  raises ConfigError naming the first that is not."""
  for group in GROUPS:
    known = sorted(key.split('.')[1] for key in KEYS if key.startswith(f'{group}.'))
    for key in _get(config, group):
      if key not in known:
        _fail(f'{group}.{key}', config[group][key],
              f'unknown {group} key; known: {", ".join(known)}')
  for key in config:
    if key not in KEYS and key not in GROUPS:
      _fail(key, config[key], 'unknown key; configs/default.py lists every key')
  for key, spec in KEYS.items():
    spec.check(key, _get(config, key))
  _check_relations(config)
  return config


def check_resume(stored: dict, config: ml_collections.ConfigDict, path) -> list[str]:
  """Raises ConfigError where `config` changes a 'fixed' key (`Key.resume`) of the run's stored
  config (at `path`, read by `read_stored`); returns a warning for each 'order' key it changes."""
  current = json.loads(config.to_json())
  warnings = []
  for key, spec in KEYS.items():
    old, new = _lookup(stored, key), _lookup(current, key)
    if spec.resume == 'fixed' and old != new:
      raise ConfigError(f'config.{key}={new!r} conflicts with {old!r} in {path}; resume with the '
                        'stored value or start a new --workdir')
    if spec.resume == 'order' and old != new:
      warnings.append(f'config.{key}={new!r} differs from {old!r} in {path}: the resumed run '
                      'sees other batches than an uninterrupted one would')
  return warnings


def parent_of(tree: dict, key: str, make: bool = False) -> tuple[dict | None, str]:
  """The dict holding a dotted `key` in `tree` (its groups made where `make`), and its last part;
  None where a group is not a dict."""
  *groups, leaf = key.split('.')
  for group in groups:
    if make and group not in tree:
      tree[group] = {}
    tree = tree.get(group)
    if not isinstance(tree, dict):
      return None, leaf
  return tree, leaf


def _lookup(tree: dict, key: str):
  """`tree`'s value at a dotted key, or None."""
  parent, leaf = parent_of(tree, key)
  return None if parent is None else parent.get(leaf)


def model_config(config: ml_collections.ConfigDict, implementations=None) -> TransformerConfig:
  """The model of a validated experiment config.

  Args:
    config: the experiment config.
    implementations: how the model computes (`kernels.choice.Implementations`); None: the plain
      forms, XLA's attention and DenseGeneral's products, which compute the same.
  """
  model = dict(config.model)
  model['dtype'] = DTYPES[model['dtype']]
  model['param_dtype'] = DTYPES[model['param_dtype']]
  model['output_projection_dtype'] = DTYPES.get(model.get('output_projection_dtype', ''))
  if implementations is not None:
    model.update(attention_implementation=implementations.attention,
                 attention_projection=implementations.attention_projection)
  return TransformerConfig(vocab_size=config.vocab_size, **model)


def compound_split(config: ml_collections.ConfigDict, target_lang: str) -> bool:
  """Whether the paper BLEU of translations into `target_lang` splits compounds (##AT##)."""
  return target_lang in config.compound_split_languages.split(',')
