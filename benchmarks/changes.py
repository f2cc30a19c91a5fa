r"""What each speed change bought: benchmarks/vs_flax.py on the tree of each commit in CHANGES.

  python -m benchmarks.changes [--repeats=5]

For each commit, its configs/ and transformer/ are extracted with `git archive` and timed as ours
by `benchmarks.vs_flax --ours=...` (train step 128x32 and beam search 64x24), against flax
examples/wmt in the same process; the last row is this checkout as it is. Absolute times drift
with the machine's load between rows; the flax / ours ratio of each row was measured in one
process and is the figure to compare. Writes benchmarks/results/changes.{json,md}.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from benchmarks.measure import write_results


_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed repeats per side in each vs_flax run.')
_OUTPUT = flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                              'Where changes.json and changes.md go.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (commit, what it changed), oldest first.
CHANGES = (
    ('1f5e6f1', 'baseline: before the speed work'),
    ('13720dc', 'beam search: caches in the layout the step reads, row-copy reorder, cache grown '
                'in stages of 16 positions'),
    ('4b0a8f0', "train step: dropout bits from XLA's RngBitGenerator; accuracy from the max logit "
                'instead of an argmax'),
    ('ce55349', 'train step: dropout bits from a counter hash fused into the masking layer '
                '(transformer/hash_rng.py)'),
    ('d648509', 'train step: output projection and loss chunk by chunk, chunks of padding '
                'skipped (transformer/loss.py)'),
)


def git(*args: str) -> str:
  return subprocess.run(['git', *args], cwd=ROOT, check=True, capture_output=True,
                        text=True).stdout.strip()


def vs_flax(ours: str, output: str) -> dict:
  """benchmarks.vs_flax's results with `ours` ('' for this checkout) timed as ours."""
  subprocess.run([sys.executable, '-m', 'benchmarks.vs_flax', f'--ours={ours}',
                  '--train_shapes=128x32', f'--repeats={_REPEATS.value}', f'--output={output}'],
                 cwd=ROOT, check=True, stdout=sys.stderr)
  with open(os.path.join(output, 'vs_flax.json')) as f:
    return json.load(f)


def main(argv):
  del argv
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for commit, change in CHANGES:
      tree = os.path.join(tmp, commit)
      os.makedirs(tree)
      archive = subprocess.run(['git', 'archive', commit, 'configs', 'transformer'], cwd=ROOT,
                               check=True, capture_output=True).stdout
      subprocess.run(['tar', '-x', '-C', tree], input=archive, check=True)
      rows.append({'commit': commit, 'change': change,
                   **vs_flax(tree, os.path.join(tmp, commit + '-results'))})
    dirty = bool(git('status', '--porcelain', '--', 'configs', 'transformer'))
    rows.append({'commit': git('rev-parse', '--short', 'HEAD') + (' + edits' if dirty else ''),
                 'change': 'this checkout', **vs_flax('', os.path.join(tmp, 'current-results'))})
  table = markdown(rows)
  write_results(_OUTPUT.value, 'changes', rows, table)


def markdown(rows: list[dict]) -> str:
  machine = rows[-1]['machine']
  lines = [
      f'benchmarks/vs_flax.py per commit, medians of {rows[-1]["repeats"]} alternating repeats '
      f'on {machine["cores"]} cores ({machine["cpu"]}), jax {machine["jax"]}. Times in seconds; '
      'flax / ours measured in one process per row.',
      '',
      '| commit | change | train 128x32: ours | flax | flax / ours | beam 4, 64x24: ours | '
      'flax | flax / ours |',
      '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for row in rows:
    (train,), beam = row['train'], row['beam']
    cells = []
    for step in (train, beam):
      ours, flax = step['sides']['ours'], step['sides']['flax']
      cells.append(f'{ours["secs"]:.3f} | {flax["secs"]:.3f} | {ours["speedup"]:.2f}x')
    lines.append(f'| {row["commit"]} | {row["change"]} | {" | ".join(cells)} |')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  app.run(main)
