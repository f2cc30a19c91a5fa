r"""Training curves of train.py runs, from their metrics.jsonl.

  python -m transformer.plots --workdir=DIR [--workdir=DIR2 ...] [--output=curves.png]

One figure: loss, perplexity, learning rate and validation BLEU against the step (top row) and
against hours since the run's first logged row (bottom row). Each run is one colour, named by its
workdir; training is a solid line, validation dashed with dots, and the BLEU of checkpoint averages
(the end of training) a circle (validation) or a star (test). Written to --output, by default
DIR/curves.png of the first workdir.
"""

import io
import itertools
import json
import os
import sys

from absl import app, flags
from etils import epath
from matplotlib.figure import Figure  # no pyplot: no GUI backend, so it runs headless

from transformer.files import write_atomically

# (title, metric, rows it is read from: 'train' or an evaluation split, logarithmic y axis)
PANELS = (
    ('loss (label-smoothed)', 'loss', ('train', 'validation'), False),
    ('perplexity', 'perplexity', ('train', 'validation'), True),
    ('learning rate', 'learning_rate', ('train',), False),
    ('sacreBLEU', 'sacrebleu', ('validation', 'test'), False),
)


class PlotError(ValueError):
  """Unusable input; the message names the file and line."""


def read_metrics(workdir: str) -> list[dict]:
  """The rows of DIR/metrics.jsonl; a last line without its newline is still being written."""
  path = os.path.join(workdir, 'metrics.jsonl')
  try:
    lines = epath.Path(path).read_text(encoding='utf-8').splitlines(keepends=True)
  except FileNotFoundError:
    raise PlotError(f'{path} not found: --workdir takes a train.py workdir') from None
  if lines and not lines[-1].endswith('\n'):
    lines.pop()
  rows = []
  for number, line in enumerate(lines, 1):
    try:
      row = json.loads(line)
    except json.JSONDecodeError as error:
      raise PlotError(f'{path}:{number} is not JSON ({error.msg}): delete or mend that '
                      'line') from None
    if not isinstance(row, dict) or not isinstance(row.get('step'), int):
      raise PlotError(f'{path}:{number} is not a metrics row (a JSON object with an integer '
                      '"step"): delete or mend that line')
    rows.append(row)
  return rows


def series(rows: list[dict], split: str, metric: str,
           averaged: bool = False) -> list[tuple[int, float, float | None]]:
  """(step, value, seconds since the first row or None) of `metric` in `split`'s rows, in step
  order: those of the current parameters, or (`averaged`) of checkpoint averages, as at the end
  of training. A resumed run logs again from its checkpoint's step: later rows replace earlier
  ones."""
  start = next((row['time'] for row in rows if 'time' in row), None)
  points = {}
  for row in rows:
    if (row.get('split', 'train') == split and metric in row
        and ('checkpoint_steps' in row) == averaged):
      for step in [s for s in points if s >= row['step']]:
        del points[step]
      seconds = row['time'] - start if 'time' in row and start is not None else None
      points[row['step']] = (row['step'], row[metric], seconds)
  return sorted(points.values())


def curves(runs: dict[str, list[dict]]) -> Figure:
  """The figure of `runs`: {name: metrics rows}."""
  figure = Figure(figsize=(4 * len(PANELS), 6.5), layout='constrained')
  axes = figure.subplots(2, len(PANELS))
  colours = [f'C{i % 10}' for i in range(len(runs))]
  for column, (title, metric, splits, log_scale) in enumerate(PANELS):
    for row, x_label in enumerate(('step', 'hours')):
      ax = axes[row, column]
      for colour, (name, rows) in zip(colours, runs.items()):
        for split, averaged in itertools.product(splits, (False, True)):
          points = series(rows, split, metric, averaged)
          if row == 1:
            points = [p for p in points if p[2] is not None]
          if not points:
            continue
          xs = [p[0] if row == 0 else p[2] / 3600 for p in points]
          if averaged:  # checkpoint averages: points, not a curve
            style = dict(linestyle='none', marker='*' if split == 'test' else 'o', markersize=8)
          else:
            style = dict(linestyle='-') if split == 'train' else dict(linestyle='--', marker='.')
          label = f'{name} ({split}{", averaged" if averaged else ""})'
          ax.plot(xs, [p[1] for p in points], color=colour, label=label, **style)
      ax.set_title(f'{title} ({", ".join(splits)})' if len(splits) == 1 else title)
      ax.set_xlabel(x_label)
      if log_scale:
        ax.set_yscale('log')
      ax.grid(alpha=0.3)
  handles, labels = {}, []
  for ax in axes.flat:  # one legend for the figure: each (run, split) once
    for handle, label in zip(*ax.get_legend_handles_labels()):
      if label not in handles:
        handles[label] = handle
        labels.append(label)
  if labels:
    figure.legend([handles[label] for label in labels], labels, loc='outside lower center',
                  ncols=min(len(labels), 4))
  return figure


def run_names(workdirs: list[str]) -> list[str]:
  """Each workdir's last path component, or the whole path where two runs share it."""
  names = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  return [n if names.count(n) == 1 else os.path.normpath(w) for n, w in zip(names, workdirs)]


def save(figure: Figure, path: str):
  """Writes the figure as a PNG, atomically."""
  buffer = io.BytesIO()
  figure.savefig(buffer, format='png', dpi=80)
  write_atomically(path, buffer.getvalue())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    runs = {name: read_metrics(w) for name, w in zip(run_names(FLAGS.workdir), FLAGS.workdir)}
  except PlotError as error:
    sys.exit(f'plots: {error}')
  for name, rows in runs.items():
    if rows and not any('time' in row for row in rows):
      print(f'plots: {name} logged no wall-clock times (a run from before they were logged): '
            'its curves are against step only', file=sys.stderr)
  output = FLAGS.output or os.path.join(FLAGS.workdir[0], 'curves.png')
  save(curves(runs), output)
  print(f'wrote {output}')


if __name__ == '__main__':
  flags.DEFINE_multi_string('workdir', None, 'A train.py workdir (repeat to compare runs).')
  flags.DEFINE_string('output', None, 'PNG to write (default: <first workdir>/curves.png).')
  flags.mark_flag_as_required('workdir')
  FLAGS = flags.FLAGS
  app.run(main)
