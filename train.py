r"""Trains a Transformer: `python train.py --config=configs/X.py --workdir=DIR [--config.key=value]`.

A workdir that holds checkpoints is resumed from the latest one. Several hosts: run the same
command on each with --coordinator_address=HOST:PORT --num_processes=N --process_id=I (Cloud TPU
VMs and other clusters JAX knows are detected without them).
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('train.py')

import gc
import socket
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from transformer import config as config_lib
from transformer import checkpoints, commands, data, lock, marian, metrics, trainer
from transformer.files import DirectoryError

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (configs/*.py).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for config.json, metrics.jsonl and '
                               'checkpoints/; an existing one is resumed.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None,
                                   'HOST:PORT of process 0, for multi-host training.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of hosts (processes).')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This host\'s index in [0, num_processes).')
flags.mark_flags_as_required(['config', 'workdir'])


def multi_host_flags() -> tuple[str, int, int] | None:
  """(--coordinator_address, --num_processes, --process_id), checked; None where none is given.

  JAX reports a bad value with a traceback, and an unknown host by aborting the process after a
  5-minute wait: both fail here first, in one line.
  """
  address, num_processes, process_id = given = (_COORDINATOR.value, _NUM_PROCESSES.value,
                                                _PROCESS_ID.value)
  if given == (None, None, None):
    return None
  if None in given:
    raise app.UsageError('--coordinator_address, --num_processes and --process_id go together')
  if num_processes < 1:
    raise app.UsageError(f'--num_processes={num_processes} must be >= 1')
  if not 0 <= process_id < num_processes:
    raise app.UsageError(f'--process_id={process_id} must be in [0, --num_processes='
                         f'{num_processes})')
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise app.UsageError(f'--coordinator_address={address} must be HOST:PORT of process 0, '
                         'e.g. 10.0.0.1:1234')
  try:
    socket.getaddrinfo(host.strip('[]'), int(port))
  except socket.gaierror as error:
    raise app.UsageError(f'--coordinator_address={address}: host {host} is unknown '
                         f'({error.strerror}); give the name or IP address of process 0\'s host')
  return given


def initialize_distributed():
  """Joins the other hosts: from the flags, else from a cluster JAX detects, else runs alone."""
  if given := multi_host_flags():
    jax.distributed.initialize(*given)
  else:
    try:
      jax.distributed.initialize()
    except (ValueError, RuntimeError) as error:  # no cluster around: one process
      logging.info('single process (%s)', error)
  commands.start_backend()
  if jax.process_index() != 0:
    logging.set_verbosity(logging.WARNING)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  # The libraries' objects live as long as the run: full collections, which pause every thread
  # (the steps' dispatch too), then skip them.
  gc.freeze()
  try:
    commands.set_up_jax(config_lib.validate(_CONFIG.value), start=False)
    initialize_distributed()
    if jax.default_backend() == 'gpu':
      # The threads beside the loop (checkpoint saves, the evaluation programs' compilation) hand
      # the interpreter back after 0.5 ms instead of 5: the loop dispatches a step every few ms
      # and waited out the saver's turns (docs/speed.md). Not on a CPU, where it bought nothing
      # and slowed the threads' own work when the cores were busy.
      sys.setswitchinterval(5e-4)
    trainer.train(_CONFIG.value, _WORKDIR.value)
  except (config_lib.ConfigError, data.DataError, checkpoints.CheckpointError,
          DirectoryError, lock.LockedError, marian.MarianError, metrics.TrainingError) as error:
    sys.exit(f'train.py: {error}')


if __name__ == '__main__':
  commands.run(main, 'train.py', config_flag=True)
