r"""Trains a Transformer: `python train.py --config=configs/X.py --workdir=DIR [--config.key=value]`.

Multi-host: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I on every host
(on Cloud TPU VMs JAX finds these itself).
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from transformer import config as config_lib
from transformer.model import parameter_count

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (configs/*.py).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for config.json, metrics.jsonl and '
                               'checkpoints/; an existing one is resumed.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None,
                                   'HOST:PORT of process 0, for multi-host training.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of hosts (processes).')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This host\'s index in [0, num_processes).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    config = config_lib.validate(_CONFIG.value)
  except config_lib.ConfigError as error:
    sys.exit(f'train.py: {error}')
  print(f'model: {parameter_count(config_lib.model_config(config)):,} parameters')
  sys.exit('train.py: the training loop is not implemented yet; the config above is valid.')


if __name__ == '__main__':
  app.run(main)
