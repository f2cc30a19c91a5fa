"""Where a split's text comes from: config.dataset picks synthetic, Multi30k, local files or TFDS.

Every source gives a `Corpus`: random access to (source, target) pairs in the split's own order,
so the batcher reads only the pairs it needs. TFDS datasets are read TF-free, through
`tfds.data_source` over array_record files (no tensorflow dependency; random access is what the
length-grouped, resumable batching needs).
"""

import os
import time
from collections.abc import Callable, Sequence

import ml_collections
import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from transformer.data import multi30k, synthetic, text_files
from transformer.data.errors import DataError

SPLITS = ('train', 'validation', 'test')
_DATASETS = ("a TFDS translation dataset such as 'wmt14_translate/de-en', or 'multi30k', 'text' "
             "or 'synthetic'")


class Corpus:
  """A split as `len(corpus)` pairs; `corpus.texts(indices)` -> (sources, targets)."""

  def __init__(self, name: str, size: int, read: Callable[[Sequence[int]], tuple[list, list]]):
    self.name = name
    self._size = size
    self._read = read

  def __len__(self) -> int:
    return self._size

  def texts(self, indices: Sequence[int]) -> tuple[list[str], list[str]]:
    return self._read(indices)


def _in_memory(name: str, sources: list[str], targets: list[str]) -> Corpus:
  return Corpus(name, len(sources),
                lambda indices: ([sources[i] for i in indices], [targets[i] for i in indices]))


def _from_data_source(name: str, source, source_lang: str, target_lang: str) -> Corpus:
  def text(value) -> str:
    return value.decode('utf-8') if isinstance(value, bytes) else str(value)

  def read(indices):
    examples = [source[i] for i in indices]
    return ([text(e[source_lang]) for e in examples], [text(e[target_lang]) for e in examples])

  if len(source):
    languages = sorted(source[0])
    for lang in (source_lang, target_lang):
      if lang not in languages:
        raise DataError(f'{name} has no language {lang!r} (it has {", ".join(languages)}); set '
                        'config.source_lang and config.target_lang to two of those')
  return Corpus(name, len(source), read)


def _text_corpus(config: ml_collections.ConfigDict, split: str) -> Corpus:
  key = f'{split}_files'
  pattern = config[key]
  if not pattern:
    raise DataError(f'config.{key} is empty: name the {split} files of dataset=text, e.g. '
                    f"--config.{key}=data/{split}.{{lang}}.gz ({{lang}} = a language code)")
  paths = [pattern.replace('{lang}', lang) for lang in (config.source_lang, config.target_lang)]
  return _in_memory(f'{pattern} ({split})', *text_files.read_parallel(*paths))


def _multi30k_corpus(config: ml_collections.ConfigDict, split: str) -> Corpus:
  if config.manual_dir and not epath.Path(config.manual_dir).is_dir():
    raise DataError(f'config.manual_dir={config.manual_dir!r}: no such directory; give the '
                    'directory holding train/val/test_2016_flickr.{en,de,fr}.gz, or leave it '
                    'empty to download them')
  tfds.disable_progress_bar()
  root = config.tfds_data_dir or tfds.core.constants.DATA_DIR
  paths = multi30k.source_files(config.manual_dir, os.path.join(root, 'downloads'))
  digest = multi30k.sources_digest(paths)
  prepared = os.path.join(root, 'multi30k_sources', digest[:16])
  builder = multi30k.Multi30k(paths=paths, data_dir=prepared, file_format='array_record')
  if not builder.is_prepared():
    logging.info('preparing multi30k from %s (files sha256 %s) in %s',
                 config.manual_dir or 'the download', digest[:16], prepared)
    began = time.time()
    builder.download_and_prepare()
    logging.info('prepared multi30k in %.1f s', time.time() - began)
  return _from_data_source(f'multi30k ({split})', builder.as_data_source(split),
                           config.source_lang, config.target_lang)


def _tfds_corpus(config: ml_collections.ConfigDict, split: str) -> Corpus:
  # TFDS registers its translation builders only when their package is imported.
  import tensorflow_datasets.translate  # pylint: disable=g-import-not-at-top,unused-import
  try:
    source = tfds.data_source(config.dataset, split=split, data_dir=config.tfds_data_dir or None,
                              builder_kwargs=dict(file_format='array_record'))
  except tfds.core.registered.DatasetNotFoundError:
    raise DataError(f'config.dataset={config.dataset!r}: no such TFDS dataset; use '
                    f'{_DATASETS}') from None
  return _from_data_source(f'{config.dataset} ({split})', source, config.source_lang,
                           config.target_lang)


def load_split(config: ml_collections.ConfigDict, split: str) -> Corpus:
  """The pairs of `split` ('train', 'validation' or 'test') in config.source/target_lang order."""
  if split not in SPLITS:
    raise DataError(f'unknown split {split!r}; use one of {", ".join(SPLITS)}')
  if config.dataset == 'synthetic':
    return _in_memory(f'synthetic ({split})', *synthetic.pairs(split))
  if config.dataset == 'text':
    return _text_corpus(config, split)
  if config.dataset == 'multi30k':
    return _multi30k_corpus(config, split)
  if '/' in config.dataset:
    return _tfds_corpus(config, split)
  raise DataError(f'config.dataset={config.dataset!r}: unknown dataset; use {_DATASETS}')


def split_texts(config: ml_collections.ConfigDict, split: str) -> tuple[list[str], list[str]]:
  """All (sources, references) of `split` as raw text, in the split's order (for BLEU)."""
  corpus = load_split(config, split)
  return corpus.texts(range(len(corpus)))
