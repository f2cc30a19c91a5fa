"""Multi30k (task 1: English, German, French image captions) as a TFDS dataset, TF-free.

Splits: train (29000 pairs), validation (1014, files `val.*`), test (1000, `test_2016_flickr.*`).
Downloads the public files, or reads the same files from a local directory (`local_dir`).
"""

import os

import tensorflow_datasets as tfds

from transformer.data import text_files

LANGUAGES = ('en', 'de', 'fr')
FILE_PREFIXES = {'train': 'train', 'validation': 'val', 'test': 'test_2016_flickr'}
URL = 'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{name}'


class Multi30k(tfds.core.GeneratorBasedBuilder):
  """One example per line: {'en': ..., 'de': ..., 'fr': ...}, in file order."""

  VERSION = tfds.core.Version('1.0.0')

  def __init__(self, *, local_dir: str = '', **kwargs):
    self._local_dir = local_dir
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description='Multi30k task 1: Flickr30k image captions in English, German and French.',
        features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in LANGUAGES}),
        homepage='https://github.com/multi30k/dataset',
        disable_shuffling=True)  # keep file order, so evaluation follows the reference files

  def _split_generators(self, dl_manager):
    names = [f'{prefix}.{lang}.gz' for prefix in FILE_PREFIXES.values() for lang in LANGUAGES]
    if self._local_dir:
      paths = {name: os.path.join(self._local_dir, name) for name in names}
    else:
      paths = dl_manager.download({name: URL.format(name=name) for name in names})
    return {split: self._generate_examples({lang: os.fspath(paths[f'{prefix}.{lang}.gz'])
                                            for lang in LANGUAGES})
            for split, prefix in FILE_PREFIXES.items()}

  def _generate_examples(self, paths: dict[str, str]):
    columns = {}
    for lang in LANGUAGES[1:]:  # each language checked for alignment against English
      columns['en'], columns[lang] = text_files.read_parallel(paths['en'], paths[lang])
    for index in range(len(columns['en'])):
      yield index, {lang: columns[lang][index] for lang in LANGUAGES}
