"""Checks an experiment config (an ml_collections.ConfigDict from configs/) before anything runs.

`validate` raises one `ConfigError` naming the first bad key, its value and how to fix it;
`model_config` turns a valid config into the model's `TransformerConfig`; `load_workdir_config`
reads the config.json of a run, written by any earlier version.
"""

import contextlib
import dataclasses
import json
import numbers
import os
import re

import jax.numpy as jnp
import ml_collections
from etils import epath

from transformer import marian
from transformer.model import TransformerConfig

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}
MULTI30K_LANGUAGES = ('en', 'de', 'fr')
# Datasets without a TFDS name; anything of the form 'name/config' is looked up in TFDS.
LOCAL_DATASETS = ('multi30k', 'synthetic', 'text')
SCHEDULES = ('paper', 'warmup_rsqrt')
BYTE_AND_SPECIAL_PIECES = 256 + 3  # every vocabulary holds these besides what it learns
# Set by the code for each use of the model (training, evaluation, decoding), never by a config.
RUN_MODE_FIELDS = {'vocab_size', 'deterministic', 'decode', 'attention_projection'}


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


@contextlib.contextmanager
def fixes_in_run_config(workdir: str):
  """Raises a SettingError of the block again with its fix as an edit of the config.json of the
  run in `workdir` (`SettingError.for_run`): for the commands that read a run's config, which no
  --config flag sets."""
  try:
    yield
  except SettingError as error:
    raise type(error)(error.for_run(os.path.join(workdir, 'config.json'))) from None


class ConfigError(SettingError):
  """A config value that cannot work; the message names the key and the fix."""


def _fail(key: str, value, problem: str, fix: str = '', example: bool = False):
  raise ConfigError(f'config.{key}={value!r}: {problem}', key, fix, example)


def _get(config: ml_collections.ConfigDict, key: str):
  node = config
  for part in key.split('.'):
    if part not in node:
      raise ConfigError(f'config.{key} is missing: add it to the config file '
                        '(configs/default.py lists every key)', key)
    node = node[part]
  return node


def _check_int(config, key: str, minimum: int):
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    _fail(key, value, f'must be an integer >= {minimum}', 'N')
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


def language_pairs(config: ml_collections.ConfigDict) -> list[tuple[str, str]]:
  """(source, target) of each language pair the model translates: config.pairs's, or else the
  one of config.source_lang and target_lang."""
  if config.get('pairs'):
    return [tuple(pair.split('-')) for pair in config.pairs.split(',')]
  return [(config.source_lang, config.target_lang)]


def language_tag(lang: str) -> str:
  """The piece that starts each source of a multilingual model (config.pairs) to ask for `lang`."""
  return f'<2{lang}>'


def _check_pairs(config: ml_collections.ConfigDict):
  tags = _get(config, 'source_tags')
  if not isinstance(tags, str) or tags and not all(
      re.fullmatch(r'<[^\s<>,]+>', tag) for tag in tags.split(',')):
    _fail('source_tags', tags, "must be comma-separated tags such as '<BT>' (no spaces), or empty")
  if tags and config.init_from:
    _fail('source_tags', tags, "a Marian model's vocabulary (config.init_from) takes no new "
          'pieces: leave it empty')
  pairs = _get(config, 'pairs')
  if not isinstance(pairs, str):
    _fail('pairs', pairs, "must be comma-separated language pairs, e.g. 'en-de,en-fr', or empty")
  if not pairs:
    return
  example = "comma-separated pairs of two language codes, e.g. 'en-de,en-fr'"
  for pair in pairs.split(','):
    languages = pair.split('-')
    if len(languages) != 2 or not all(re.fullmatch(r'[A-Za-z_]+', lang) for lang in languages):
      _fail('pairs', pairs, f'{pair!r} is not a language pair; give {example}')
    if languages[0] == languages[1]:
      _fail('pairs', pairs, f'{pair!r} translates a language into itself; give {example}')
    if config.dataset == 'multi30k' and not set(languages) <= set(MULTI30K_LANGUAGES):
      _fail('pairs', pairs, f'{pair!r}: Multi30k has {", ".join(MULTI30K_LANGUAGES)} only')
  if len(set(pairs.split(','))) != len(pairs.split(',')) or len(pairs.split(',')) < 2:
    _fail('pairs', pairs, f'a multilingual model needs two or more different pairs; give {example}, '
          'or leave it empty for config.source_lang-config.target_lang')
  first = language_pairs(config)[0]
  if (config.source_lang, config.target_lang) != first:
    _fail('pairs', pairs, f'its first pair is {"-".join(first)} but config.source_lang-'
          f'config.target_lang is {config.source_lang}-{config.target_lang}: set those to the '
          'first pair')
  clash = {language_tag(target) for _, target in language_pairs(config)} & set(tags.split(','))
  if clash:
    _fail('source_tags', tags, f'{clash.pop()} is the tag of a target language of config.pairs '
          'already')
  if config.init_from:
    _fail('pairs', pairs, 'a Marian model (config.init_from) has no tags of ours for its target '
          'languages: fine-tune it on one pair, with config.pairs empty')


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
  _check_choice(config, 'loss_reduction', ('', 'separate', 'online'))
  _check_choice(config, 'attention_projection', ('', 'matrix', 'heads'))
  if not isinstance(_get(config, 'init_from'), str):
    _fail('init_from', config.init_from, 'must be a Hugging Face Marian directory or empty')
  if _check_int(config, 'vocab_size', 1) <= BYTE_AND_SPECIAL_PIECES and not config.init_from:
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
  _check_choice(config, 'model.layer_norm', ('post', 'pre'))
  _check_choice(config, 'model.dtype', tuple(DTYPES))
  _check_choice(config, 'model.param_dtype', tuple(DTYPES))
  if 'output_projection_dtype' in config.model:  # not in a config.json from before it
    _check_choice(config, 'model.output_projection_dtype', ('', *DTYPES))
  _check_choice(config, 'model.share_embeddings', (True, False))
  _check_choice(config, 'model.tie_output_embedding', (True, False))
  for key, choices in ADDED_MODEL_KEY_CHOICES.items():
    if key in config.model:  # not in a config.json from before it
      _check_choice(config, f'model.{key}', choices)

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
  _check_pairs(config)
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
    _fail('train_files', '', "dataset='text' reads its training pairs from these files",
          "'data/train.{lang}.gz'", example=True)

  # Optimisation.
  _check_choice(config, 'schedule', SCHEDULES)
  _check_real(config, 'lr_scale', 0.0, float('inf'))
  _check_real(config, 'peak_learning_rate', 0.0, float('inf'))
  _check_int(config, 'warmup_steps', 1)
  _check_real(config, 'adam_b1', 0.0, 1.0)
  _check_real(config, 'adam_b2', 0.0, 1.0)
  _check_real(config, 'adam_eps', 0.0, float('inf'))
  _check_real(config, 'grad_clip_norm', 0.0, float('inf'))
  steps = _check_int(config, 'num_train_steps', 1)
  if _check_int(config, 'cooldown_steps', 0) > steps:
    _fail('cooldown_steps', config.cooldown_steps,
          f'the cooldown is part of config.num_train_steps={steps}: lower it or raise that')
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
  final_splits = _get(config, 'final_bleu_splits')
  if not isinstance(final_splits, str) or final_splits and not set(
      final_splits.split(',')) <= {'validation', 'test'}:
    _fail('final_bleu_splits', final_splits, "must be 'validation', 'test', both "
          "('validation,test') or empty (none)")
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


def model_config(config: ml_collections.ConfigDict, implementations=None) -> TransformerConfig:
  """The model of a validated experiment config.

  Args:
    config: the experiment config.
    implementations: how the model computes (`kernels.choice.Implementations`); None: the plain
      forms, XLA's attention and DenseGeneral's products, which compute the same.
  """
  model = dict(config.model)
  model.pop('attention_implementation', None)
  model['dtype'] = DTYPES[model['dtype']]
  model['param_dtype'] = DTYPES[model['param_dtype']]
  model['output_projection_dtype'] = DTYPES.get(model.get('output_projection_dtype', ''))
  if implementations is not None:
    model.update(attention_implementation=implementations.attention,
                 attention_projection=implementations.attention_projection)
  return TransformerConfig(vocab_size=config.vocab_size, **model)


def with_imported_model(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` (changed in place) with the architecture and vocab_size of config.init_from's
  Marian model, if set; its dropout rates stay the config's.

  Raises:
    ConfigError: config.init_from is not a Marian directory this model can represent; the message
      names the file or field.
  """
  if not config.init_from:
    return config
  try:
    imported = marian.check_directory(config.init_from)
    keys = marian.model_keys(imported)
  except marian.MarianError as error:
    raise ConfigError(f'config.init_from={config.init_from!r}: {error}') from None
  config.model.update({key: value for key, value in keys.items()
                       if key not in marian.TRAINING_KEYS})
  config.vocab_size = imported['vocab_size']
  return config


def compound_split(config: ml_collections.ConfigDict, target_lang: str) -> bool:
  """Whether the paper BLEU of translations into `target_lang` splits compounds (##AT##)."""
  return target_lang in config.compound_split_languages.split(',')


# Keys added after the first runs, each with the value that keeps the behaviour from before it: a
# config.json written before them reads as if it held these.
ADDED_KEYS = {'decode_batch_tokens': 0, 'compilation_cache_dir': '',
              'preemption_check_every_steps': 10, 'compound_split_languages': 'de,en,fr',
              'loss_reduction': 'separate', 'xla_flags': '', 'attention_projection': 'heads',
              'cooldown_steps': 0, 'init_from': '', 'final_bleu_splits': 'validation,test',
              'pairs': '', 'source_tags': ''}
# Model keys added after the first runs (Marian's variants, transformer/marian.py), each with its
# choices; the first is the value that keeps the behaviour from before it.
ADDED_MODEL_KEY_CHOICES = {'activation': ('relu', 'swish', 'gelu'),
                           'attention_bias': (False, True), 'output_bias': (False, True),
                           'scale_embedding': (True, False)}
# Implementations since removed, each read as the default that computes the same.
REMOVED_MODEL_KEYS = ('norm_implementation',)
REMOVED_VALUES = {'loss_reduction': {'pallas': ''}}


def with_added_keys(stored: dict) -> dict:
  """A stored config.json's dict as this version reads it: the ADDED_KEYS and model keys
  (ADDED_MODEL_KEY_CHOICES) it lacks added, and what names a removed implementation replaced by
  the default."""
  config = {**ADDED_KEYS, **stored}
  if isinstance(config.get('model'), dict):
    added = {key: choices[0] for key, choices in ADDED_MODEL_KEY_CHOICES.items()}
    config['model'] = {key: value for key, value in {**added, **config['model']}.items()
                       if key not in REMOVED_MODEL_KEYS}
  for key, replaced in REMOVED_VALUES.items():
    if isinstance(config.get(key), str):
      config[key] = replaced.get(config[key], config[key])
  return config


def read_stored(path: epath.Path) -> dict:
  """The keys of a workdir's config.json at `path`, as this version reads them
  (`with_added_keys`).

  Raises:
    ConfigError: it is missing, a directory, not UTF-8, not JSON or not a JSON object.
  """
  fix = 'restore it from the config file the run was started with'
  try:
    stored = json.loads(path.read_bytes().decode('utf-8'))
  except (FileNotFoundError, NotADirectoryError):
    raise ConfigError(f'{path} not found: --workdir must be a directory train.py wrote') from None
  except IsADirectoryError:
    raise ConfigError(f'{path} is a directory, not the file train.py writes; {fix}') from None
  except UnicodeDecodeError as error:
    raise ConfigError(f'{path} is not UTF-8 text ({error.reason} at byte {error.start}); '
                      f'{fix}') from None
  except json.JSONDecodeError as error:
    raise ConfigError(f'{path} is not valid JSON ({error}); {fix}') from None
  except OSError as error:  # a symlink loop, no permission, an I/O error
    raise ConfigError(f'{path} cannot be read ({error.strerror or error}): --workdir must be a '
                      'directory train.py wrote, readable by this user') from None
  if not isinstance(stored, dict):
    raise ConfigError(f'{path} holds a JSON {type(stored).__name__}, not an object of config '
                      f'keys; {fix}')
  return with_added_keys(stored)


def load_workdir_config(workdir: str, defaults=None) -> ml_collections.ConfigDict:
  """The validated config.json that train.py wrote in `workdir`; for a Hugging Face Marian
  directory, `marian_directory_config(workdir, defaults())`, where `defaults` gives a full config
  (configs/default.py's `get_config`).

  Raises:
    ConfigError: it is missing, unreadable, or holds a value this version refuses; the message
      names the file.
  """
  if marian.is_marian_directory(workdir):
    if defaults is None:
      raise ConfigError(f'{workdir} is a Hugging Face Marian directory, not a train.py workdir: '
                        'eval.py and translate.py take it as --workdir, train.py as '
                        '--config.init_from')
    return marian_directory_config(workdir, defaults())
  path = epath.Path(workdir) / 'config.json'
  try:
    return validate(ml_collections.ConfigDict(read_stored(path)))
  except ConfigError as error:
    message = error.for_run(path)
    raise ConfigError(message if str(path) in message else f'{path}: {message}') from None


def marian_directory_config(directory: str,
                            config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` (changed in place) set to translate with the Marian model in `directory` as it is:
  its architecture and vocabulary (config.init_from), computed in float32 as transformers does,
  the beam size and length penalty's alpha of its generation_config.json
  (`marian.decoding_keys`) and the languages its model card names; validated.

  Raises:
    ConfigError: the directory holds a model or a setting this codebase cannot take; named.
  """
  config.init_from = directory
  with_imported_model(config)
  config.model.dtype = 'float32'
  try:
    config.update(marian.decoding_keys(directory))
    config.source_lang, config.target_lang = (marian.card_languages(directory) or
                                              (config.source_lang, config.target_lang))
    return validate(config)
  except (marian.MarianError, ConfigError, TypeError) as error:  # TypeError: a value's type
    raise ConfigError(f'{directory}: {error}') from None
