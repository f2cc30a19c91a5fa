r"""Averages the parameters of a run's last N checkpoints into a new workdir.

  python average_checkpoints.py --workdir=DIR --last=5 --output_workdir=OUT
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
from transformer.files import write_atomically

_WORKDIR = flags.DEFINE_string('workdir', None, 'The train.py workdir to average.')
_LAST = flags.DEFINE_integer('last', 5, 'How many of the newest checkpoints (paper: 5 base, 20 '
                             'big).')
_OUTPUT_WORKDIR = flags.DEFINE_string('output_workdir', None, 'New directory for the average.')
flags.mark_flags_as_required(['workdir', 'output_workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    config = config_lib.load_workdir_config(_WORKDIR.value)
    steps = checkpoints.write_average(_WORKDIR.value, _OUTPUT_WORKDIR.value, config, _LAST.value)
  except (config_lib.ConfigError, checkpoints.CheckpointError) as error:
    sys.exit(f'average_checkpoints.py: {error}')
  averaged_config = json.loads(config.to_json())
  averaged_config['average_last'] = 1
  write_atomically(os.path.join(_OUTPUT_WORKDIR.value, 'config.json'),
                   json.dumps(averaged_config, indent=2, sort_keys=True) + '\n')
  write_atomically(os.path.join(_OUTPUT_WORKDIR.value, vocabulary.MODEL_FILE),
                   epath.Path(_WORKDIR.value, vocabulary.MODEL_FILE).read_bytes())
  print(f'averaged steps {steps} into {_OUTPUT_WORKDIR.value}')


if __name__ == '__main__':
  app.run(main)
