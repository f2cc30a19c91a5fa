"""Checks an experiment config (an ml_collections.ConfigDict from configs/) before anything runs.

`validate` raises one `ConfigError` naming the first bad key, its value and how to fix it;
`model_config` turns a valid config into the model's `TransformerConfig`; `parse_flags` reads a
command line with a `--config` file flag, and its mistakes, as one ConfigError too.
"""

import dataclasses
import json
import numbers
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
from absl import flags, logging
from jax._src import xla_bridge  # backends_are_initialized: jax has no public check
from etils import epath

from transformer import files, fused_attention
from transformer.model import TransformerConfig

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}
MULTI30K_LANGUAGES = ('en', 'de', 'fr')
# Datasets without a TFDS name; anything of the form 'name/config' is looked up in TFDS.
LOCAL_DATASETS = ('multi30k', 'synthetic', 'text')
SCHEDULES = ('paper', 'warmup_rsqrt')
BYTE_AND_SPECIAL_PIECES = 256 + 3  # every vocabulary holds these besides what it learns
# Set by the code for each use of the model (training, evaluation, decoding), never by a config.
RUN_MODE_FIELDS = {'vocab_size', 'deterministic', 'decode'}


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key and the fix."""


def _fail(key: str, value, problem: str):
  raise ConfigError(f'config.{key}={value!r}: {problem}')


def _get(config: ml_collections.ConfigDict, key: str):
  node = config
  for part in key.split('.'):
    if part not in node:
      raise ConfigError(f'config.{key} is missing: add it to the config file '
                        '(configs/default.py lists every key)')
    node = node[part]
  return node


def _check_int(config, key: str, minimum: int):
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    _fail(key, value, f'must be an integer >= {minimum}; pass --config.{key}=N')
  return value


def _check_real(config, key: str, low: float, high: float, high_inclusive=False):
  value = _get(config, key)
  upper_ok = value <= high if high_inclusive else value < high
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (low <= value and
                                                                           upper_ok):
    bracket = ']' if high_inclusive else ')'
    _fail(key, value, f'must be a number in [{low}, {high}{bracket}')
  return value


def _check_choice(config, key: str, choices):
  value = _get(config, key)
  if value not in choices:
    _fail(key, value, f'must be one of {", ".join(map(repr, choices))}')
  return value


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Returns `config` unchanged if every key is usable, else raises ConfigError."""
  # Model.
  model_keys = {f.name for f in dataclasses.fields(TransformerConfig)} - RUN_MODE_FIELDS
  for key in _get(config, 'model'):
    if key not in model_keys:
      _fail(f'model.{key}', config.model[key],
            f'unknown model key; known: {", ".join(sorted(model_keys))}')
  d_model = _check_int(config, 'model.d_model', 2)
  if d_model % 2:
    _fail('model.d_model', d_model, 'must be even (sine/cosine positional encoding pairs)')
  num_heads = _check_int(config, 'model.num_heads', 1)
  if d_model % num_heads:
    _fail('model.num_heads', num_heads,
          f'model.d_model={d_model} must be divisible by it (d_k = d_v = d_model / heads); '
          f'choose a divisor of {d_model}')
  for key in ('model.d_ff', 'model.num_encoder_layers', 'model.num_decoder_layers',
              'model.max_positions'):
    _check_int(config, key, 1)
  _check_int(config, 'loss_chunk_tokens', 0)
  _check_choice(config, 'loss_reduction', ('', 'separate', 'online', 'pallas'))
  _check_choice(config, 'attention_projection', ('', 'matrix', 'heads'))
  if _check_int(config, 'vocab_size', 1) <= BYTE_AND_SPECIAL_PIECES:
    _fail('vocab_size', config.vocab_size, f'256 byte pieces and 3 special ids take '
          f'{BYTE_AND_SPECIAL_PIECES} of it, and the pieces learned from the text come on top; '
          'use at least a few hundred more')
  for key in ('model.dropout_rate', 'model.attention_dropout_rate', 'model.relu_dropout_rate',
              'label_smoothing'):
    _check_real(config, key, 0.0, 1.0)
  _check_real(config, 'model.layer_norm_epsilon', 0.0, 1.0)
  _check_choice(config, 'model.positional_encoding', ('sinusoidal', 'learned'))
  if 'attention_implementation' in config.model:
    _check_choice(config, 'model.attention_implementation', ('', 'xla', 'cudnn', 'pallas'))
  if 'norm_implementation' in config.model:
    _check_choice(config, 'model.norm_implementation', ('xla', 'pallas'))
  _check_choice(config, 'model.layer_norm', ('post', 'pre'))
  _check_choice(config, 'model.dtype', tuple(DTYPES))
  _check_choice(config, 'model.param_dtype', tuple(DTYPES))
  _check_choice(config, 'model.share_embeddings', (True, False))
  _check_choice(config, 'model.tie_output_embedding', (True, False))

  # Data.
  dataset = _get(config, 'dataset')
  if not isinstance(dataset, str) or ('/' not in dataset and dataset not in LOCAL_DATASETS):
    _fail('dataset', dataset, f'unknown dataset; use one of {", ".join(LOCAL_DATASETS)} or a '
          "TFDS translation dataset such as 'wmt14_translate/de-en'")
  source, target = _get(config, 'source_lang'), _get(config, 'target_lang')
  if source == target:
    _fail('target_lang', target, 'must differ from config.source_lang')
  if dataset == 'multi30k':
    _check_choice(config, 'source_lang', MULTI30K_LANGUAGES)
    _check_choice(config, 'target_lang', MULTI30K_LANGUAGES)
  if not isinstance(_get(config, 'manual_dir'), str):
    _fail('manual_dir', config.manual_dir, 'must be a directory path or empty')
  _check_choice(config, 'vocab_model_type', ('bpe', 'unigram'))
  if not isinstance(_get(config, 'compound_split_languages'), str):
    _fail('compound_split_languages', config.compound_split_languages,
          "must be comma-separated language codes, e.g. 'de', or empty")
  max_length = _check_int(config, 'max_length', 1)
  _check_int(config, 'tokens_per_batch', max_length)
  _check_choice(config, 'packing', (True, False))
  _check_int(config, 'vocab_sample_size', 1)
  for key in ('tfds_data_dir', 'train_files', 'validation_files', 'test_files'):
    value = _get(config, key)
    if not isinstance(value, str):
      _fail(key, value, 'must be a path or empty')
    if key == 'tfds_data_dir' and '://' in value:
      _fail(key, value, 'TFDS writes and reads its array_record files with local file calls; '
            'give a local directory, or mount the bucket (gcsfuse) and give the mount\'s path')
    if key.endswith('_files') and value and '{lang}' not in value:
      _fail(key, value, "must contain '{lang}', replaced by source_lang and target_lang, e.g. "
            "'data/train.{lang}.gz'")
  if dataset == 'text' and not config.train_files:
    _fail('train_files', '', "dataset='text' reads its training pairs from these files; pass e.g. "
          "--config.train_files='data/train.{lang}.gz'")

  # Optimisation.
  _check_choice(config, 'schedule', SCHEDULES)
  _check_real(config, 'lr_scale', 0.0, float('inf'))
  _check_real(config, 'peak_learning_rate', 0.0, float('inf'))
  _check_int(config, 'warmup_steps', 1)
  _check_real(config, 'adam_b1', 0.0, 1.0)
  _check_real(config, 'adam_b2', 0.0, 1.0)
  _check_real(config, 'adam_eps', 0.0, float('inf'))
  _check_real(config, 'grad_clip_norm', 0.0, float('inf'))
  _check_int(config, 'num_train_steps', 1)
  _check_int(config, 'grad_accum_steps', 1)
  _check_int(config, 'seed', 0)
  _check_choice(config, 'dropout_rng_impl', ('hash', 'rbg', 'unsafe_rbg', 'threefry2x32'))
  if not isinstance(_get(config, 'compilation_cache_dir'), str):
    _fail('compilation_cache_dir', config.compilation_cache_dir, 'must be a directory or empty')
  xla_flags = _get(config, 'xla_flags')
  if not isinstance(xla_flags, str) or not all(
      re.fullmatch(r'--xla_\w+=\S+', flag) for flag in xla_flags.split()):
    _fail('xla_flags', xla_flags, "must be empty or space-separated '--xla_name=value' flags")

  # Logging and checkpoints (0 = never).
  for key in ('log_every_steps', 'eval_every_steps', 'bleu_every_steps',
              'checkpoint_every_steps', 'checkpoint_every_secs'):
    _check_int(config, key, 0)
  _check_int(config, 'preemption_check_every_steps', 1)
  keep = _check_int(config, 'keep_checkpoints', 1)
  average_last = _check_int(config, 'average_last', 1)
  if average_last > keep:
    _fail('average_last', average_last,
          f'averaging needs that many checkpoints kept; raise config.keep_checkpoints ({keep})')

  # Decoding.
  _check_int(config, 'beam_size', 1)
  _check_int(config, 'decode_batch_tokens', 0)
  _check_real(config, 'alpha', 0.0, float('inf'))
  extra = _check_int(config, 'decode_extra_length', 0)
  if config.model.positional_encoding == 'learned' and (config.model.max_positions <
                                                        max_length + extra):
    _fail('model.max_positions', config.model.max_positions,
          f'learned positions must cover max_length + decode_extra_length = {max_length + extra}')
  return config


def model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
  """The model architecture of a validated experiment config, on this backend."""
  model = dict(config.model)
  model['dtype'] = DTYPES[model['dtype']]
  model['param_dtype'] = DTYPES[model['param_dtype']]
  model['attention_implementation'] = attention_implementation(config)
  model['norm_implementation'] = norm_implementation(config)
  return TransformerConfig(vocab_size=config.vocab_size,
                           attention_projection=attention_projection(config), **model)


def fused_kernels_run() -> bool:
  """Whether this backend's devices run the fused kernels (cuDNN's attention, the Pallas kernels).

  NVIDIA GPUs of compute capability 8.0 or later: Ampere, where bfloat16 tensor cores start, on;
  the kernels are tested and tuned on Hopper. Older GPUs and ROCm's (whose capability is a gfx
  name) run XLA's implementations, which compute the same.
  """
  if jax.default_backend() != 'gpu':
    return False
  major, _, minor = str(getattr(jax.devices()[0], 'compute_capability', '')).partition('.')
  return major.isdigit() and minor.isdigit() and (int(major), int(minor)) >= (8, 0)


def _fused_kernels_need() -> str:
  """What the fused kernels need and what this backend is, for ConfigError messages."""
  here = jax.default_backend()
  if here == 'gpu':
    device = jax.devices()[0]
    here = (f"{device.device_kind}, compute capability "
            f"{getattr(device, 'compute_capability', 'unknown')}")
  return f'an NVIDIA GPU of compute capability 8.0 or later (here: {here})'


def attention_implementation(config: ml_collections.ConfigDict) -> str:
  """'xla', 'cudnn' or 'pallas' (see TransformerConfig); raises ConfigError where the chosen
  fused kernel cannot run.

  config.model.attention_implementation='' picks by backend. On a GPU that runs the fused kernels
  (`fused_kernels_run`), when the model computes in bfloat16 or float16 without attention
  dropout: the Pallas kernels (transformer/fused_attention.py) where heads have a depth that is a
  power of 2 from 16 and max_length is up to 128 (base_train's step on an H200: 23.0 ms with them
  and the layer norm's and loss's kernels, 24.4 ms with cuDNN's attention and either;
  benchmarks/results/gpu_speed_h200.md); else cuDNN's fused kernel where the depth is a multiple
  of 8 up to 128. Else XLA's. A config.json written before the key existed reads as ''.
  """
  chosen = config.model.get('attention_implementation', '')
  half = config.model.dtype in ('bfloat16', 'float16')
  depth = config.model.d_model // config.model.num_heads
  fused = half and config.model.attention_dropout_rate == 0 and fused_kernels_run()
  needs = (f'{_fused_kernels_need()}, '
           f"model.dtype bfloat16 or float16 (now {config.model.dtype!r}), "
           f'model.attention_dropout_rate=0 (now {config.model.attention_dropout_rate}) and ')
  cudnn_usable = fused and depth % 8 == 0 and depth <= 128
  pallas_usable = (fused and depth >= 16 and depth & (depth - 1) == 0 and
                   config.max_length <= fused_attention.MAX_LENGTH)
  if chosen == 'cudnn' and not cudnn_usable:
    _fail('model.attention_implementation', chosen,
          f'cuDNN attention needs {needs}d_model / num_heads a multiple of 8 up to 128 '
          f"(now {depth}); use 'xla' or '' (by backend)")
  if chosen == 'pallas' and not pallas_usable:
    _fail('model.attention_implementation', chosen,
          f'the fused attention kernels need {needs}d_model / num_heads a power of 2 from 16 '
          f'(now {depth}) and max_length up to {fused_attention.MAX_LENGTH} (now '
          f"{config.max_length}); use 'xla' or '' (by backend)")
  return chosen or ('pallas' if pallas_usable else 'cudnn' if cudnn_usable else 'xla')


def norm_implementation(config: ml_collections.ConfigDict) -> str:
  """'xla' or 'pallas' (see TransformerConfig); raises ConfigError where the Pallas kernels
  cannot run. A config.json written before the key existed reads as 'xla'."""
  chosen = config.model.get('norm_implementation', 'xla')
  width = config.model.d_model
  if chosen == 'pallas' and (not fused_kernels_run() or config.model.layer_norm != 'post'
                             or width & (width - 1)):
    _fail('model.norm_implementation', chosen,
          f'the fused layer norm kernels need {_fused_kernels_need()}, '
          f"model.layer_norm='post' (now {config.model.layer_norm!r}) and model.d_model a power "
          f"of 2 (now {width}); use 'xla'")
  return chosen


def for_this_backend(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A stored run's config with each model implementation this backend cannot run replaced by
  the default ('' = by backend, 'xla'), each replacement logged: they choose how the model
  computes, not what, so a run trained with a GPU's kernels translates anywhere."""
  config = ml_collections.ConfigDict(config.to_dict())
  for key, check, default in (('attention_implementation', attention_implementation, ''),
                              ('norm_implementation', norm_implementation, 'xla')):
    try:
      check(config)
    except ConfigError:
      logging.warning("config.model.%s=%r: not on this backend (%s); %r instead", key,
                      config.model[key], jax.default_backend(), default)
      config.model[key] = default
  return config


def attention_projection(config: ml_collections.ConfigDict) -> str:
  """'matrix' or 'heads' (see TransformerConfig).

  config.attention_projection='' picks by backend: 'heads' on a CPU, where 'matrix' made the
  train step ~5% slower, and 'matrix' elsewhere: with the heads as axes of their own, XLA's GPU
  matmuls computed the attention's weight gradients transposed, and summing their split-K parts
  transposed them back, 54 against 4 us per 512x512 weight on an H100 (docs/speed.md). A
  config.json written before the key existed reads as 'heads'.
  """
  if config.attention_projection:
    return config.attention_projection
  return 'heads' if jax.default_backend() == 'cpu' else 'matrix'


def loss_chunk(config: ml_collections.ConfigDict) -> int | None:
  """Target positions per chunk of the loss's output projection; None: the whole batch at once.

  config.loss_chunk_tokens=0 picks by backend: chunks of 256 on a CPU, where small chunks run
  fastest, and none on an accelerator, where a chunk loop runs its steps one after another.
  """
  if config.loss_chunk_tokens:
    return config.loss_chunk_tokens
  return 256 if jax.default_backend() == 'cpu' else None


def loss_reduction(config: ml_collections.ConfigDict) -> str:
  """How the loss reads the logits (`loss.projected_token_sums`): 'separate' (once per
  statistic), 'online' (once forward, `loss.online_token_sums`) or 'pallas' (once, the gradient
  written in the same program, transformer/fused_loss.py; a GPU, no loss chunks). Raises
  ConfigError where 'pallas' cannot run.

  config.loss_reduction='' picks by backend: 'online' on a GPU, where each pass over the logits
  is memory-bound; 'separate' on a CPU, where XLA's variadic reduction is several times slower,
  and on a TPU, where the choice is unmeasured.
  """
  if config.loss_reduction == 'pallas' and (not fused_kernels_run() or loss_chunk(config)):
    _fail('loss_reduction', 'pallas',
          f'the fused loss kernel needs {_fused_kernels_need()} and '
          f"loss_chunk_tokens=0 (now {config.loss_chunk_tokens}); use 'online' or ''")
  if config.loss_reduction:
    return config.loss_reduction
  return 'online' if jax.default_backend() == 'gpu' else 'separate'


def decode_batch_tokens(config: ml_collections.ConfigDict) -> int:
  """Source tokens times beam_size per beam-search call and device.

  config.decode_batch_tokens=0 picks by backend: on a CPU the training batch's share of a device
  (larger calls gain nothing there); on an accelerator 2**17, enough rows to keep it busy.
  """
  if config.decode_batch_tokens:
    return config.decode_batch_tokens
  if jax.default_backend() == 'cpu':
    return config.tokens_per_batch // (config.grad_accum_steps * jax.local_device_count())
  return 2**17


def compound_split(config: ml_collections.ConfigDict) -> bool:
  """Whether the paper BLEU of config.target_lang splits compounds (##AT##)."""
  return config.target_lang in config.compound_split_languages.split(',')


def use_compilation_cache(config: ml_collections.ConfigDict):
  """Keeps every compiled program in config.compilation_cache_dir, if set, for later runs.

  Raises:
    files.DirectoryError: it cannot be a directory (JAX would warn at every program and compile
      on).
  """
  if config.compilation_cache_dir:
    path = os.path.expanduser(config.compilation_cache_dir)
    files.make_directory(path, 'config.compilation_cache_dir')
    jax.config.update('jax_compilation_cache_dir', path)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)


def _check_xla_flags(config: ml_collections.ConfigDict, flags_to_add: list[str]):
  """Raises ConfigError for a flag XLA does not know or a value it cannot read.

  XLA reads XLA_FLAGS once, and on such a flag ends the process with a fatal log (for a bad value,
  after printing every flag it has): jaxlib reads them first in a subprocess (0.1 s).
  """
  result = subprocess.run(
      [sys.executable, '-c', 'from jaxlib import _jax; _jax.CompileOptions()'],
      env={**os.environ, 'XLA_FLAGS': ' '.join(flags_to_add)}, capture_output=True, text=True,
      check=False)
  if result.returncode == 0:
    return
  reasons = [line.split('] ', 1)[-1].rstrip('.') for line in result.stderr.splitlines()
             if 'Unknown flag in XLA_FLAGS' in line or "Couldn't interpret value" in line]
  if not reasons:  # not XLA's flag parsing: jaxlib itself failed, unrelated to the flags
    logging.warning('config.xla_flags not checked: %s', result.stderr.strip()[-300:])
    return
  _fail('xla_flags', config.xla_flags,
        f'XLA rejects it ({reasons[0]}); see `XLA_FLAGS=--help python -c "import jax; '
        'jax.devices()"` for the flags this jaxlib knows')


def use_xla_flags(config: ml_collections.ConfigDict):
  """Adds config.xla_flags to the XLA_FLAGS environment variable, which XLA reads when JAX starts
  its backend: call it before anything runs on a device. A flag XLA_FLAGS already names keeps
  the environment's value.

  Raises:
    ConfigError: XLA does not know one of the flags, or cannot read its value.
  """
  current = os.environ.get('XLA_FLAGS', '').split()
  named = {flag.split('=')[0] for flag in current}
  missing = [flag for flag in config.xla_flags.split() if flag.split('=')[0] not in named]
  if not missing:
    return
  _check_xla_flags(config, missing)
  if xla_bridge.backends_are_initialized():
    logging.warning('config.xla_flags %s not applied: JAX started its backend before; set '
                    'XLA_FLAGS before the process starts', ' '.join(missing))
    return
  os.environ['XLA_FLAGS'] = ' '.join(current + missing)


# Keys added after the first runs, each with the value that keeps the behaviour from before it: a
# config.json written before them reads as if it held these.
ADDED_KEYS = {'decode_batch_tokens': 0, 'compilation_cache_dir': '',
              'preemption_check_every_steps': 10, 'compound_split_languages': 'de,en,fr',
              'loss_reduction': 'separate', 'xla_flags': '', 'attention_projection': 'heads'}


def with_added_keys(stored: dict) -> dict:
  """A stored config.json's dict with the ADDED_KEYS it lacks."""
  return {**ADDED_KEYS, **stored}


def load_workdir_config(workdir: str) -> ml_collections.ConfigDict:
  """The validated config.json that train.py wrote in `workdir`."""
  path = epath.Path(workdir) / 'config.json'
  try:
    config = ml_collections.ConfigDict(with_added_keys(json.loads(path.read_text())))
  except (FileNotFoundError, NotADirectoryError):
    raise ConfigError(f'{path} not found: --workdir must be a directory train.py wrote') from None
  except json.JSONDecodeError as error:
    raise ConfigError(f'{path} is not valid JSON ({error}); restore it from the config '
                      'file the run was started with') from None
  return validate(config)


def parse_flags(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS,
                name: str = 'config') -> list[str]:
  """absl's parsing of `argv` into `flag_values`, whose `--{name}` is an ml_collections config
  file flag. ml_collections reports a missing file, an argument its get_config rejects, or an
  unknown --{name}.key as a traceback; each raises one ConfigError naming the flag instead."""
  overrides = [arg for arg in argv[1:] if arg.startswith(f'--{name}.')]
  value = next((arg for arg in argv[1:] if arg.startswith(f'--{name}=')), f'--{name}')
  try:
    remaining = flag_values(argv)
    getattr(flag_values[name].value, 'get', None)  # ml_collections defers a failed load to here
  except OSError as error:  # the file is missing: the message ends with the path tried
    raise ConfigError(f'{value}: {str(error).strip().splitlines()[-1].strip()}') from None
  except flags.Error as error:
    if 'Error whilst parsing config file' not in str(error):
      raise
    # The last line of the traceback ml_collections puts in the message: get_config's exception.
    problem = str(error).strip().splitlines()[-1].split(': ', 1)[-1]
    raise ConfigError(problem if value.split('=', 1)[-1] in problem else
                      f'{value}: {problem}') from None
  except (KeyError, AttributeError) as error:
    while error.args and isinstance(error.args[0], BaseException):  # AttributeError(KeyError)
      error = error.args[0]
    key, _, did_you_mean = str(error.args[0] if error.args else error).partition('\n')
    key = key.strip("'")
    override = next((arg for arg in overrides
                     if key in arg.split('=', 1)[0].split('.')), ' '.join(overrides))
    problem = f'no key {key!r} in the config' if key.isidentifier() else key
    raise ConfigError(f'{override}: {problem}. {did_you_mean}'.strip()) from None
  return remaining


def flags_parser(command: str):
  """An absl `flags_parser` for `command` (e.g. 'train.py'): `parse_flags`, and a bad --config
  ends the command with one line, `<command>: <what is wrong>`."""
  def parse(argv: list[str]) -> list[str]:
    try:
      return parse_flags(argv)
    except (ConfigError, flags.Error) as error:
      sys.exit(f'{command}: {error}')
  return parse
