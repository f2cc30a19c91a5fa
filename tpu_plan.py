r"""Whether a config's programs compile for a Cloud TPU slice and fit its chips' memory, checked on
a machine without a TPU, before renting one.

  pip install -e '.[tpu]'  # libtpu, whose compile-only client needs no TPU
  python tpu_plan.py --config=configs/wmt14.py:big,en-de --topology=v4:2x2x4
      [--config.key=value ...] [--lengths_from=TOKEN_STORE] [--programs=train,eval,beam_search]
      [--name=NAME]

libtpu compiles for a named slice (`jax.experimental.topologies`), as MaxText's train_compile does,
laid out as a Cloud TPU VM slice of that shape is: one JAX device per chip, hosts of 4 chips (of 8
for v5e and v6e slices of up to 8 chips). The programs are train.py's on that slice, pmapped over
all its devices, as every host runs them: the train step (with grad_accum_steps > 1, its
gradient, accumulation and update programs), the evaluation step and beam search at the decode
batch (implementation.decode_batch_tokens); --programs names some of the three kinds, e.g.
`train` alone while choosing a batch. The implementations are those a TPU runs
(`kernels.choice`): none of the GPU kernels.

A batch holds a device's share of tokens_per_batch in real tokens, and padding besides: rows are
as many as hold the budget at the mean real tokens per row of their length (`batching`), so the
shapes depend on the pairs' lengths. They are taken from a train split's token store
(--lengths_from, the directory prepare.py names for it) or else from WMT-like lengths
(`stand_in_lengths`), and the train step is compiled at the shapes that take the most memory
(`batch_shapes`): packed, the one shape of max_length rows; in length buckets, the longest at the
most rows it can have, and the one with the most [rows x length] slots. For each program it
prints, per device: the parameters and optimizer state, the temporaries, the total against the
memory libtpu lets a program take (a little under the chip's HBM, whose size from Google's pages
is shown beside it), the compiled FLOPs against the model FLOPs of the real tokens (6 per
parameter and token, as train.py logs them), the compile seconds and whether it fits. A program
that does not fit ends the command with status 1 and a line saying what to change. --name=NAME
also puts the plan in benchmarks/results/NAME.{json,md}, a row per config and slice. The work is
transformer/tpu_plan.py's.
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('tpu_plan.py')

import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the only backend this runs on; libtpu compiles
# libtpu otherwise holds a lock file that any other process loading it (a JAX on this machine
# looking for a TPU) makes it fail on; compiling needs no TPU to itself.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import commands  # noqa: E402
from transformer import config as config_lib  # noqa: E402
from transformer.tpu_plan import (PROGRAMS, PlanError, advice, details, markdown,  # noqa: E402
                                  plan, stored_lengths)

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    lengths = stored_lengths(FLAGS.lengths_from) if FLAGS.lengths_from else None
    result = plan(FLAGS.config, FLAGS.topology, lengths,
                  FLAGS.lengths_from and f'the lengths in {FLAGS.lengths_from}', FLAGS.programs)
    result['command'] = ' '.join(['python tpu_plan.py', *sys.argv[1:]])
  except (config_lib.ConfigError, PlanError) as error:
    sys.exit(f'tpu_plan.py: {error}')
  if FLAGS.name:  # a row per config and slice; a new plan of the same replaces it
    label = ' '.join(arg for arg in sys.argv[1:]
                     if not arg.startswith(('--name', '--results_dir')))
    from benchmarks.measure import add_row  # pylint: disable=import-outside-toplevel
    add_row(FLAGS.results_dir, FLAGS.name, label, result, markdown)
  else:
    print(details(result))
  if line := advice(result, FLAGS.config):
    sys.exit(f'tpu_plan.py: {line}')


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.', lock_config=True)
  flags.DEFINE_string('topology', None, "A slice's topology, e.g. 'v5e:2x2' (v5e-4), "
                      "'v4:2x2x4' (v4-32), 'v5p:2x2x2', 'v6e:2x4'.")
  flags.DEFINE_string('lengths_from', '', "A train split's token store (the directory "
                      'prepare.py names for it): batches shaped for its pairs\' lengths instead '
                      'of WMT-like ones.')
  flags.DEFINE_list('programs', list(PROGRAMS), 'The kinds of program to compile: some of '
                    f'{",".join(PROGRAMS)}.')
  flags.DEFINE_string('name', '', 'Write <results_dir>/<name>.{json,md} too.')
  flags.DEFINE_string('results_dir', os.path.join(os.path.dirname(__file__), 'benchmarks',
                                                  'results'), 'Where --name goes.')
  flags.mark_flags_as_required(['config', 'topology'])
  commands.run(main, 'tpu_plan.py', config_flag=True)
