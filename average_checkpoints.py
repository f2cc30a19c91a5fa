r"""Averages the parameters of a run's last N checkpoints into a new workdir.

  python average_checkpoints.py --workdir=DIR --average_last=5 [--up_to_step=S] --output_dir=OUT
  python eval.py --workdir=OUT --output_dir=OUT/eval

OUT gets the run's config.json (with average_last=1: its one checkpoint is already the average)
and vocabulary, and one checkpoint at the newest averaged step; --up_to_step averages the last
checkpoints at or before step S, the run as it stood then. A new or empty local OUT appears whole
or not at all. (eval.py averages the last config.average_last checkpoints in memory without
writing anything.)
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('average_checkpoints.py')

import json
import os
import sys

from absl import app, flags
from etils import epath

from transformer import checkpoints, commands, data, files
from transformer import config as config_lib
from transformer import stored_config
from transformer.data import vocabulary

_WORKDIR = flags.DEFINE_string('workdir', None, 'The train.py workdir to average.')
_AVERAGE_LAST = flags.DEFINE_integer('average_last', None, 'How many of the newest checkpoints '
                                     "(default: the config's average_last, as the paper "
                                     'evaluates: 5 for base, 20 for big).')
_UP_TO_STEP = flags.DEFINE_integer('up_to_step', None, 'Average the last checkpoints at or '
                                   'before this step: the run as it stood then (default: the '
                                   'newest).', lower_bound=0)
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'New workdir for the average.')
flags.mark_flags_as_required(['workdir', 'output_dir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  output_dir = _OUTPUT_DIR.value
  try:
    config = stored_config.load_workdir_config(_WORKDIR.value)
    commands.start_backend()
    vocab = data.load_vocabulary(config, _WORKDIR.value)
    last = config.average_last if _AVERAGE_LAST.value is None else _AVERAGE_LAST.value
    averaged_config = json.loads(config.to_json())
    averaged_config['average_last'] = 1

    def write(directory: str) -> list[int]:
      steps = checkpoints.write_average(_WORKDIR.value, directory, config, last,
                                        _UP_TO_STEP.value)
      vocabulary.write(vocab, directory)
      # Last: a config.json makes the directory a workdir other commands read.
      files.write_atomically(os.path.join(directory, 'config.json'),
                             json.dumps(averaged_config, indent=2, sort_keys=True) + '\n')
      return steps

    with files.made_for_the_block(output_dir, '--output_dir'):
      files.check_writable(os.path.join(output_dir, 'config.json'), '--output_dir')
      if epath.Path(output_dir, 'config.json').exists():
        raise files.DirectoryError(f'--output_dir: {output_dir} holds a config.json already (a '
                                   "run's workdir?); choose a new directory")
      if files.is_remote(output_dir) or os.listdir(output_dir):
        steps = write(output_dir)  # beside what is there; a bucket renames no directory
      else:  # whole or not at all: an average cut short leaves nothing to block its rerun
        steps = files.write_directory(output_dir, write)
  except (config_lib.ConfigError, checkpoints.CheckpointError, data.DataError,
          files.DirectoryError) as error:
    sys.exit(f'average_checkpoints.py: {error}')
  print(f'averaged steps {steps} into {output_dir}')


if __name__ == '__main__':
  commands.run(main, 'average_checkpoints.py')
