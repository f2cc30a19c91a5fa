"""A run's stored config: the config.json that train.py writes (`check_and_write`), read as this
version reads it whichever version wrote it (`load_workdir_config`), and the config of a Hugging
Face Marian directory taken as a run (`marian_directory_config`).
"""

import contextlib
import json
import os

import jax
import ml_collections
from absl import logging
from etils import epath

from transformer import marian
from transformer.checkpoints import CHECKPOINTS_DIR
from transformer.config import (KEYS, MISSING, ConfigError, SettingError, check_resume,
                                parent_of, validate)
from transformer.data import vocabulary
from transformer.files import write_atomically


@contextlib.contextmanager
def fixes_in_run_config(workdir: str):
  """Raises a SettingError of the block again with its fix as an edit of the config.json of the
  run in `workdir` (`SettingError.for_run`): for the commands that read a run's config, which no
  --config flag sets."""
  try:
    yield
  except SettingError as error:
    raise type(error)(error.for_run(os.path.join(workdir, 'config.json'))) from None


# Where a key of an older config.json lives now; keys since removed (their implementations
# computed what the default does); removed values, each read as the default that computes the same.
MOVED_KEYS = {'model.attention_implementation': 'implementation.attention',
              'attention_projection': 'implementation.attention_projection',
              'loss_chunk_tokens': 'implementation.loss_chunk_tokens',
              'loss_reduction': 'implementation.loss_reduction',
              'dropout_rng_impl': 'implementation.dropout_rng',
              'decode_batch_tokens': 'implementation.decode_batch_tokens'}
REMOVED_KEYS = ('model.norm_implementation',)
REMOVED_VALUES = {'implementation.loss_reduction': {'pallas': ''}}


def with_added_keys(stored: dict) -> dict:
  """A stored config.json's dict as this version reads it: the keys an older version kept
  elsewhere moved (MOVED_KEYS), removed ones dropped, removed values replaced by the default, and
  each key it lacks that has an `added` value (`KEYS`) set to that."""
  config = json.loads(json.dumps(stored))  # a copy
  for old, new in MOVED_KEYS.items():
    parent, leaf = parent_of(config, old)
    if parent is not None and leaf in parent:
      target, new_leaf = parent_of(config, new, make=True)
      if target is not None:
        target.setdefault(new_leaf, parent.pop(leaf))
  for key in REMOVED_KEYS:
    parent, leaf = parent_of(config, key)
    if parent is not None:
      parent.pop(leaf, None)
  for key, spec in KEYS.items():
    parent, leaf = parent_of(config, key, make=spec.added is not MISSING)
    if parent is not None and spec.added is not MISSING:
      parent.setdefault(leaf, spec.added)
  for key, replaced in REMOVED_VALUES.items():
    parent, leaf = parent_of(config, key)
    if parent is not None and isinstance(parent.get(leaf), str):
      parent[leaf] = replaced.get(parent[leaf], parent[leaf])
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
  marian.with_imported_model(config)
  config.model.dtype = 'float32'
  try:
    config.update(marian.decoding_keys(directory))
    config.source_lang, config.target_lang = (marian.card_languages(directory) or
                                              (config.source_lang, config.target_lang))
    return validate(config)
  except (marian.MarianError, ConfigError, TypeError) as error:  # TypeError: a value's type
    raise ConfigError(f'{directory}: {error}') from None


def check_and_write(config: ml_collections.ConfigDict, workdir: str, write: bool = True):
  """Refuses to resume with a different 'fixed' key (config.KEYS), warns of a changed 'order'
  key, then records the resolved config (unless not `write`).

  A config.json alone binds nothing: a start that failed before its vocabulary (a mistyped
  dataset or path) is replaced by the next.
  """
  path = epath.Path(workdir) / 'config.json'
  made = [epath.Path(workdir, name) for name in (vocabulary.MODEL_FILE, vocabulary.MARIAN_FILE,
                                                  CHECKPOINTS_DIR)]
  if path.exists() and any(made_path.exists() for made_path in made):
    for warning in check_resume(read_stored(path), config, path):
      logging.warning('%s', warning)
  if write and jax.process_index() == 0:
    write_atomically(path, json.dumps(json.loads(config.to_json()), indent=2, sort_keys=True) +
                     '\n')
