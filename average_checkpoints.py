r"""Averages the parameters of a run's last N checkpoints into a new workdir.

  python average_checkpoints.py --workdir=DIR --average_last=5 --output_dir=OUT
  python eval.py --workdir=OUT --output_dir=OUT/eval

OUT gets the run's config.json (with average_last=1: its one checkpoint is already the average)
and vocabulary, and one checkpoint at the newest averaged step. (eval.py averages the last
config.average_last checkpoints in memory without writing anything.)
"""

import json
import os
import sys

from absl import app, flags
from etils import epath

from transformer import checkpoints
from transformer import config as config_lib
from transformer.data import vocabulary
from transformer.files import DirectoryError, make_directory, write_atomically

_WORKDIR = flags.DEFINE_string('workdir', None, 'The train.py workdir to average.')
_AVERAGE_LAST = flags.DEFINE_integer('average_last', None, 'How many of the newest checkpoints '
                                     "(default: the config's average_last, as the paper "
                                     'evaluates: 5 for base, 20 for big).')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'New workdir for the average.')
flags.mark_flags_as_required(['workdir', 'output_dir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    config = config_lib.load_workdir_config(_WORKDIR.value)
    make_directory(_OUTPUT_DIR.value, '--output_dir')
    last = config.average_last if _AVERAGE_LAST.value is None else _AVERAGE_LAST.value
    steps = checkpoints.write_average(_WORKDIR.value, _OUTPUT_DIR.value, config, last)
  except (config_lib.ConfigError, checkpoints.CheckpointError, DirectoryError) as error:
    sys.exit(f'average_checkpoints.py: {error}')
  averaged_config = json.loads(config.to_json())
  averaged_config['average_last'] = 1
  write_atomically(os.path.join(_OUTPUT_DIR.value, 'config.json'),
                   json.dumps(averaged_config, indent=2, sort_keys=True) + '\n')
  write_atomically(os.path.join(_OUTPUT_DIR.value, vocabulary.MODEL_FILE),
                   epath.Path(_WORKDIR.value, vocabulary.MODEL_FILE).read_bytes())
  print(f'averaged steps {steps} into {_OUTPUT_DIR.value}')


if __name__ == '__main__':
  app.run(main)
