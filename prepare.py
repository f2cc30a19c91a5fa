r"""Prepares a config's data before training: `python prepare.py --config=configs/X.py`.

  python prepare.py --config=configs/wmt14.py:base,en-de [--config.tfds_data_dir=DIR]
      [--config.manual_dir=DIR]

Downloads and prepares the dataset (TFDS's or Multi30k; dataset='text' files are read where they
are), trains the vocabulary and writes every split's token ids, under config.tfds_data_dir (TFDS's
default when empty). train.py with the same config (and any workdir, on any host that sees the
directory) reads them instead of doing it again. A download that fails names the files to fetch
by hand into config.manual_dir. Running it again does only what is missing.
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('prepare.py')

import sys

from absl import app, flags
from ml_collections import config_flags

from transformer import commands, data
from transformer import config as config_lib
from transformer.data import prepare
from transformer.files import DirectoryError

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (configs/*.py).',
                                          lock_config=True)
flags.mark_flags_as_required(['config'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    summary = prepare.prepare(config_lib.validate(_CONFIG.value))
  except (config_lib.ConfigError, data.DataError, DirectoryError) as error:
    sys.exit(f'prepare.py: {error}')
  print('\n'.join(summary))


if __name__ == '__main__':
  commands.run(main, 'prepare.py', config_flag=True)
