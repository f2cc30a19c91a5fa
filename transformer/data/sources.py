"""Where a split's text comes from: config.dataset picks synthetic, Multi30k, local files or TFDS.

Every source gives a `Corpus`: random access to (source, target) pairs in the split's own order,
so the batcher reads only the pairs it needs. TFDS datasets are read TF-free, through
`tfds.data_source` over array_record files (no tensorflow dependency; random access is what the
length-grouped, resumable batching needs).
"""

import contextlib
import fcntl
import functools
import hashlib
import os
import time
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from transformer import files, languages
from transformer.data import multi30k, synthetic, text_files
from transformer.data.errors import DOWNLOAD_ERRORS, DataError

SPLITS = ('train', 'validation', 'test')
_DATASETS = ("a TFDS translation dataset such as 'wmt14_translate/de-en', or 'multi30k', 'text' "
             "or 'synthetic'")
Reader = Callable[[Sequence[int]], tuple[list[str], list[str]]]
Languages = tuple[str, str]  # (source, target)


class Corpus:
  """A split as `len(corpus)` pairs; `corpus.texts(indices)` -> (sources, targets).

  `digest` names the split's content in this language order, so that what is derived from it
  (the vocabulary, the token ids) is made once and found again; `open()` gives (size, reader) and
  is called on first use only: a run whose token ids are stored never reads the text. The last
  read is kept: a first run trains its vocabulary on the pairs it then tokenizes.
  """

  def __init__(self, name: str, digest: str, open_: Callable[[], tuple[int, Reader]]):
    self.name, self.digest = name, digest
    self._open = functools.cache(open_)
    self._last_read = None  # (indices, texts)

  def __len__(self) -> int:
    return self._open()[0]

  def texts(self, indices: Sequence[int]) -> tuple[list[str], list[str]]:
    """(sources, targets) of the pairs at `indices`; the lists may be shared: do not change them."""
    indices = tuple(indices)
    if self._last_read is None or self._last_read[0] != indices:
      self._last_read = indices, self._open()[1](indices)
    return self._last_read[1]


def digest(*parts) -> str:
  """A SHA-256 (hex) naming `parts`: what stored data is keyed by."""
  return hashlib.sha256('\0'.join(map(str, parts)).encode()).hexdigest()


def _lists(sources: list[str], targets: list[str]) -> tuple[int, Reader]:
  return len(sources), lambda indices: ([sources[i] for i in indices],
                                        [targets[i] for i in indices])


def _synthetic_corpus(split: str) -> Corpus:
  sources, targets = synthetic.pairs(split)
  return Corpus(f'synthetic ({split})', digest('synthetic', *sources, *targets),
                lambda: _lists(sources, targets))


def _from_data_source(name: str, key: str, source, source_lang: str,
                      target_lang: str) -> Corpus:
  def text(value) -> str:
    return value.decode('utf-8') if isinstance(value, bytes) else str(value)

  def read(indices):
    try:  # a batch read: 2.3x faster than one record at a time
      examples = source.__getitems__(list(indices))
    except TypeError:  # TFDS's mock_data sources only read one record at a time
      examples = [source[i] for i in indices]
    return ([text(e[source_lang]) for e in examples], [text(e[target_lang]) for e in examples])

  if len(source):
    languages = sorted(source[0])
    for lang in (source_lang, target_lang):
      if lang not in languages:
        raise DataError(f'{name} has no language {lang!r} (it has {", ".join(languages)}); set '
                        'config.source_lang and config.target_lang to two of those')
  return Corpus(name, digest(key, len(source), source_lang, target_lang),
                lambda: (len(source), read))


def _text_corpus(config: ml_collections.ConfigDict, split: str, languages: Languages) -> Corpus:
  key = f'{split}_files'
  pattern = config[key]
  if not pattern:
    raise DataError(f'config.{key} is empty: name the {split} files of dataset=text ({{lang}} '
                    'is replaced by a language code)', key, f'data/{split}.{{lang}}.gz',
                    example=True)
  paths = [pattern.replace('{lang}', lang) for lang in languages]
  for path in paths:
    if not epath.Path(path).is_file():
      raise DataError(f'{path}: no such file; check config.{key} (one sentence per line, '
                      'optional .gz)', key)
  # Hashing the bytes is a fraction of reading them as text.
  return Corpus(f'{pattern} ({split})', digest('text', *map(files.sha256, paths)),
                lambda: _lists(*text_files.read_parallel(*paths)))


def _multi30k_corpus(config: ml_collections.ConfigDict, split: str,
                     languages: Languages) -> Corpus:
  if config.manual_dir and not epath.Path(config.manual_dir).is_dir():
    raise DataError(f'config.manual_dir={config.manual_dir!r}: no such directory; give the '
                    'directory holding train/val/test_2016_flickr.{en,de,fr}.gz, or leave it '
                    'empty to download them', 'manual_dir')
  tfds.disable_progress_bar()
  root = prepared_dir(config)
  paths = multi30k.source_files(config.manual_dir, os.path.join(root, 'downloads'))
  files_digest = multi30k.sources_digest(paths)
  prepared = os.path.join(root, 'multi30k_sources', files_digest[:16])

  def prepare(builder):
    logging.info('preparing multi30k from %s (files sha256 %s) in %s',
                 config.manual_dir or 'the download', files_digest[:16], prepared)
    began = time.time()
    builder.download_and_prepare()
    logging.info('prepared multi30k in %.1f s', time.time() - began)

  builder = _prepared_once(config, lambda: multi30k.Multi30k(
      paths=paths, data_dir=prepared, file_format='array_record'), prepare)
  return _from_data_source(f'multi30k ({split})', digest('multi30k', files_digest, split),
                           builder.as_data_source(split), *languages)


def _download_failed(builder, error: Exception, manual_dir: str) -> DataError:
  """What to fetch by hand, and where to put it, when TFDS cannot download a dataset's files."""
  files = ', '.join(f'{url} ({info.size / 2**20:,.0f} MiB)'
                    for url, info in sorted((builder.url_infos or {}).items()))
  where = f'config.manual_dir={manual_dir}' if manual_dir else 'one directory DIR'
  return DataError(f'{builder.info.full_name}: a download failed ({type(error).__name__}: '
                   f'{error}); fetch its files by hand into {where}, keeping their names (TFDS '
                   f'then reads them from there): '
                   f'{files or "see the dataset page on tensorflow.org"}',
                   *(() if manual_dir else ('manual_dir', 'DIR')))


def _tfds_builder(config: ml_collections.ConfigDict):
  """config.dataset's TFDS builder, downloaded and prepared (once) as array_record files.

  Raises:
    DataError: no such dataset, config or version, or a download failed (the message lists the
      files to fetch by hand into config.manual_dir), or a file there does not match its
      registered checksum.
  """
  # TFDS registers its translation builders only when their package is imported.
  import tensorflow_datasets.translate  # pylint: disable=g-import-not-at-top,unused-import
  bad = f'config.dataset={config.dataset!r}'
  try:
    name, kwargs = tfds.core.naming.parse_builder_name_kwargs(config.dataset)
    builder_configs = tfds.builder_cls(str(name)).builder_configs
  except tfds.core.registered.DatasetNotFoundError:  # a ValueError too
    raise DataError(f'{bad}: no such TFDS dataset; use {_DATASETS}') from None
  except ValueError:
    raise DataError(f'{bad}: not a TFDS name (NAME/CONFIG[:VERSION]); use {_DATASETS}') from None
  if builder_configs and kwargs.get('config') not in builder_configs:
    raise DataError(f'{bad}: {name} has no config {kwargs.get("config")!r}; use one of '
                    + ', '.join(f"'{name}/{pair}'" for pair in builder_configs))

  def make_builder():
    try:
      return tfds.builder(config.dataset, data_dir=config.tfds_data_dir or None,
                          file_format='array_record')
    except (AssertionError, TypeError) as error:  # how TFDS refuses a version or an argument
      why = str(error).split('": ', 1)[-1]  # after TFDS's repeat of the builder's arguments
      raise DataError(f'{bad}: {why}') from None

  def prepare(builder):
    logging.info('preparing %s in %s', builder.info.full_name, builder.data_dir)
    began = time.time()
    try:
      builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
          manual_dir=config.manual_dir or None))
    except tfds.core.download.download_manager.NonMatchingChecksumError as error:
      raise DataError(f'{builder.info.full_name}: a file does not match its registered checksum '
                      f'(check the copies in config.manual_dir={config.manual_dir!r}, or delete '
                      f'the partial download): {str(error).splitlines()[0]}') from None
    except DOWNLOAD_ERRORS as error:
      raise _download_failed(builder, error, config.manual_dir) from None
    logging.info('prepared %s in %.1f s', builder.info.full_name, time.time() - began)

  return _prepared_once(config, make_builder, prepare)


@contextlib.contextmanager
def writing_prepared(config: ml_collections.ConfigDict):
  """Raises a write that fails in the block (no permission, a read-only or full disk) as one
  DataError naming config.tfds_data_dir, where prepared data goes."""
  try:
    yield
  except (files.DirectoryError, OSError) as error:
    if isinstance(error, OSError) and error.errno not in files.WRITE_ERRNOS:
      raise
    raise DataError(f'config.tfds_data_dir={prepared_dir(config)!r}: prepared data cannot be '
                    f'written there ({error}); give a directory this user can write to, or one '
                    'that holds the data prepared already', 'tfds_data_dir') from None


def _prepared_once(config: ml_collections.ConfigDict, make_builder, prepare):
  """`make_builder()`'s TFDS builder, prepared (`prepare(builder)`) if it is not, by one process
  at a time: processes that share config.tfds_data_dir (hosts, two commands at once) wait for
  the one preparing, then read what it wrote, where TFDS would fail all but the first to finish."""
  builder = make_builder()
  if builder.is_prepared():
    return builder
  with writing_prepared(config), open(os.path.join(prepared_dir(config), 'prepare.lock'),
                                      'a') as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logging.info('waiting for another process that prepares data in %s', prepared_dir(config))
      fcntl.flock(lock, fcntl.LOCK_EX)
    builder = make_builder()  # anew: prepared by the other process, it reads what that wrote
    if not builder.is_prepared():
      prepare(builder)
  return builder


def _tfds_corpus(config: ml_collections.ConfigDict, split: str, languages: Languages) -> Corpus:
  builder = _tfds_builder(config)
  return _from_data_source(f'{config.dataset} ({split})',
                           digest('tfds', builder.info.full_name, split),
                           builder.as_data_source(split), *languages)


def prepared_dir(config: ml_collections.ConfigDict) -> str:
  """Where prepared data goes: TFDS datasets, vocabularies and token ids (config.tfds_data_dir,
  or TFDS's default)."""
  return os.path.expanduser(config.tfds_data_dir or tfds.core.constants.DATA_DIR)


def tagged(tag: str, sentences: list[str]) -> list[str]:
  """`sentences`, each starting with `tag` and a space; blank ones are left blank."""
  return [f'{tag} {sentence}' if sentence.strip() else sentence for sentence in sentences]


def _mixed(corpora: list[Corpus], tags: list[str]) -> Corpus:
  """The pairs of `corpora` one after another, each source tagged with its corpus's tag."""
  def open_():
    sizes = np.array([len(corpus) for corpus in corpora])
    starts = np.concatenate([[0], np.cumsum(sizes)])

    def read(indices):
      indices = np.asarray(indices, np.int64)
      part = np.searchsorted(starts, indices, side='right') - 1
      sources, targets = [None] * len(indices), [None] * len(indices)
      for n, (corpus, tag) in enumerate(zip(corpora, tags)):
        at = np.flatnonzero(part == n)
        if len(at):
          part_sources, part_targets = corpus.texts((indices[at] - starts[n]).tolist())
          for i, source, target in zip(at, tagged(tag, part_sources), part_targets):
            sources[i], targets[i] = source, target
      return sources, targets

    return int(starts[-1]), read

  return Corpus(' + '.join(f'{corpus.name} tagged {tag}' for corpus, tag in zip(corpora, tags)),
                digest('mixed', *(part for pair in zip(corpora, tags)
                                  for part in (pair[0].digest, pair[1]))), open_)


def load_split(config: ml_collections.ConfigDict, split: str,
               pair: Languages | None = None) -> Corpus:
  """The pairs of `split` ('train', 'validation' or 'test') in config.source/target_lang order;
  for a multilingual config (config.pairs), those of every pair, or of `pair` only, each source
  tagged with its target language (`languages.tag`).

  Raises:
    DataError: the data cannot be read; the message names the file or key.
    files.DirectoryError: config.tfds_data_dir, where prepared data goes, cannot be a directory.
  """
  if split not in SPLITS:
    raise DataError(f'unknown split {split!r}; use one of {", ".join(SPLITS)}')
  files.make_directory(prepared_dir(config), 'config.tfds_data_dir')
  pairs = languages.pairs(config)
  if not config.get('pairs'):
    return _pair_corpus(config, split, pairs[0])
  pairs = [pair] if pair else pairs
  return _mixed([_pair_corpus(config, split, languages) for languages in pairs],
                [languages.tag(target) for _, target in pairs])


def _pair_corpus(config: ml_collections.ConfigDict, split: str, languages: Languages) -> Corpus:
  if config.dataset == 'synthetic':
    return _synthetic_corpus(split)
  if config.dataset == 'text':
    return _text_corpus(config, split, languages)
  if config.dataset == 'multi30k':
    return _multi30k_corpus(config, split, languages)
  if '/' in config.dataset:
    return _tfds_corpus(config, split, languages)
  raise DataError(f'config.dataset={config.dataset!r}: unknown dataset; use {_DATASETS}')


def split_texts(config: ml_collections.ConfigDict, split: str,
                pair: Languages | None = None) -> tuple[list[str], list[str]]:
  """All (sources, references) of `split` (of `pair`, as `load_split`) as raw text, in the split's
  order (for BLEU)."""
  corpus = load_split(config, split, pair)
  return corpus.texts(range(len(corpus)))
