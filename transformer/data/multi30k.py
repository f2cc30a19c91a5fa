"""Multi30k (task 1: English, German, French image captions) as a TFDS dataset, TF-free.

Splits: train (29000 pairs), validation (1014, files `val.*`), test (1000, `test_2016_flickr.*`).
The nine files come from a local directory or are downloaded once; the dataset is prepared once
per distinct set of files (named by their SHA-256), so changed files are prepared anew and never
replaced by an earlier copy.
"""

import hashlib
import os

import tensorflow_datasets as tfds
from etils import epath

from transformer import files
from transformer.data import text_files
from transformer.data.errors import DOWNLOAD_ERRORS, DataError

LANGUAGES = ('en', 'de', 'fr')
FILE_PREFIXES = {'train': 'train', 'validation': 'val', 'test': 'test_2016_flickr'}
FILE_NAMES = tuple(f'{prefix}.{lang}.gz' for prefix in FILE_PREFIXES.values() for lang in LANGUAGES)
URL = 'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{name}'


def source_files(local_dir: str, download_dir: str) -> dict[str, str]:
  """{file name: path} of the nine files: those in `local_dir`, or else downloaded (once, then
  reused) into `download_dir`."""
  if not local_dir:
    urls = {name: URL.format(name=name) for name in FILE_NAMES}
    try:
      downloaded = tfds.download.DownloadManager(download_dir=download_dir).download(urls)
    except DOWNLOAD_ERRORS as error:
      raise DataError(f'multi30k: a download failed ({type(error).__name__}: {error}); fetch '
                      f'{", ".join(FILE_NAMES)} by hand from {URL.format(name="")} into one '
                      'directory DIR', 'manual_dir', 'DIR') from None
    return {name: os.fspath(path) for name, path in downloaded.items()}
  paths = {name: os.path.join(local_dir, name) for name in FILE_NAMES}
  for path in paths.values():
    if not epath.Path(path).is_file():
      raise DataError(f'{path}: no such file; config.manual_dir must hold all of '
                      f'{", ".join(FILE_NAMES)}', 'manual_dir')
  return paths


def sources_digest(paths: dict[str, str]) -> str:
  """SHA-256 over the files' names and contents."""
  digest = hashlib.sha256()
  for name in sorted(paths):
    digest.update(name.encode() + b'\0' + bytes.fromhex(files.sha256(paths[name])))
  return digest.hexdigest()


class Multi30k(tfds.core.GeneratorBasedBuilder):
  """One example per line of `paths` (from source_files): {'en': ..., 'de': ..., 'fr': ...}, in
  file order."""

  VERSION = tfds.core.Version('1.0.0')

  def __init__(self, *, paths: dict[str, str], **kwargs):
    self._paths = paths
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description='Multi30k task 1: Flickr30k image captions in English, German and French.',
        features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in LANGUAGES}),
        homepage='https://github.com/multi30k/dataset',
        disable_shuffling=True)  # keep file order, so evaluation follows the reference files

  def _split_generators(self, dl_manager):
    del dl_manager  # source_files() has the files already
    return {split: self._generate_examples({lang: self._paths[f'{prefix}.{lang}.gz']
                                            for lang in LANGUAGES})
            for split, prefix in FILE_PREFIXES.items()}

  def _generate_examples(self, paths: dict[str, str]):
    columns = {}
    for lang in LANGUAGES[1:]:  # each language checked for alignment against English
      columns['en'], columns[lang] = text_files.read_parallel(paths['en'], paths[lang])
    for index in range(len(columns['en'])):
      yield index, {lang: columns[lang][index] for lang in LANGUAGES}
