r"""Training curves of train.py runs, from their metrics.jsonl (transformer/plots.py, `curves`).

  python plot_curves.py --workdir=DIR [--workdir=DIR2 ...] [--output=curves.png]

One picture, written to --output in the format its extension names (.png, .pdf, .svg, ...), by
default DIR/curves.png of the first workdir.
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('plot_curves.py')

import os
import sys

from absl import app, flags

from transformer import commands, files, plots

_WORKDIRS = flags.DEFINE_multi_string('workdir', None, 'A train.py workdir (repeat to compare '
                                      'runs).')
_OUTPUT = flags.DEFINE_string('output', None, 'Picture to write, .png, .pdf, .svg, ... (default: '
                              '<first workdir>/curves.png).')
flags.mark_flag_as_required('workdir')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  workdirs = _WORKDIRS.value
  output = _OUTPUT.value or os.path.join(workdirs[0], 'curves.png')
  try:
    runs = {name: plots.read_metrics(w) for name, w in zip(plots.run_names(workdirs), workdirs)}
    files.check_writable(output, f'--output={output}')
    plots.image_format(output)  # before drawing
    for name, rows in runs.items():
      if not any('time' in row for row in rows):
        print(f'plot_curves.py: {name} logged no wall-clock times (a run from before they were '
              'logged): its curves are against step only', file=sys.stderr)
    plots.save(plots.curves(runs), output)
  except (plots.PlotError, files.DirectoryError) as error:
    sys.exit(f'plot_curves.py: {error}')
  print(f'wrote {output}')


if __name__ == '__main__':
  commands.run(main, 'plot_curves.py')
