r"""Multi30k reproduction: train.py from scratch, then eval.py's BLEU, as a row of a results table.

  python -m benchmarks.reproduce_multi30k --manual_dir=../shared/data/multi30k [--pair=en-de]
      [--label=NAME] [--workdir=DIR] [--override=key=value ...] [--splits=validation,test]
  python -m benchmarks.reproduce_multi30k --rescore=LABEL [--average_last=N] [--beam_size=B]
      [--alpha=A] --label=NAME
  python -m benchmarks.reproduce_multi30k --rescore=LABEL --splits=test

Trains `configs/multi30k.py:<pair>` with the overrides in a new --workdir (default
runs/reproduce/<label>), timing the whole of train.py, then eval.py scores each split. The row goes
under --label into benchmarks/results/multi30k.json; multi30k.md shows every row scored on test,
the recipe (no overrides but a seed) first; runs that differ only in their seed, as a mean and its
range; and every row's validation BLEU, as a recipe is chosen on validation only.

--rescore=LABEL trains nothing. Given --average_last, --beam_size or --alpha, eval.py scores row
LABEL's run another way: a new row, LABEL's overrides plus those, with LABEL's training minutes and
machine, on the splits LABEL was scored on (test2016 only where LABEL was: another decoding is
tuning). Without them, row LABEL is scored on the splits it lacks (test2016, once a candidate is
chosen on validation). --splits names the splits instead.

eval.py decodes as today's config with a row's overrides says, not as its run's config.json (maybe
an older recipe's). A row keeps that config.json, less the data's path, so that a test finds the
rows whose overrides no longer turn today's config into it (tests/test_benchmarks.py).
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags
from flax import traverse_util
from ml_collections import config_flags

from benchmarks.measure import add_row, commit, machine, machine_name
from configs import multi30k

MANUAL_DIR = flags.DEFINE_string('manual_dir', '../shared/data/multi30k',
                                 'Directory of the Multi30k files.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS
DECODING = ('average_last', 'beam_size', 'alpha')  # eval.py's flags, in a rescored row's order
SPLITS = ('validation', 'test')  # what a new run is scored on, unless --splits says otherwise


def run(*args: str):
  """Runs a script of this checkout with this interpreter; its output goes to stderr."""
  subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=sys.stderr)


def workdir_of(label: str) -> str:
  return os.path.abspath(FLAGS.workdir or os.path.join(ROOT, 'runs', 'reproduce', label))


def train() -> tuple[str, dict]:
  """Trains a new run; (its workdir, its row without scores)."""
  workdir = workdir_of(FLAGS.label)
  if os.path.exists(workdir):
    raise SystemExit(f'{workdir} exists: training is timed from scratch, so remove it or give '
                     'another --workdir')
  began = time.time()
  run('train.py', f'--config=configs/multi30k.py:{FLAGS.pair}', f'--workdir={workdir}',
      f'--config.manual_dir={os.path.abspath(MANUAL_DIR.value)}',
      *(f'--config.{override}' for override in FLAGS.override))
  train_minutes = (time.time() - began) / 60
  with open(os.path.join(workdir, 'config.json')) as f:
    config = json.load(f)
  del config['manual_dir']  # this machine's path
  return workdir, {'pair': FLAGS.pair, 'overrides': FLAGS.override,
                   'steps': config['num_train_steps'], 'train_minutes': train_minutes,
                   'config': config}


def rescored() -> tuple[str, str, dict, list[str]]:
  """The run of the row --rescore names; (its workdir, the label and row its scores go to, the
  splits to score): a new row with the decoding changes given, on the splits the row named was
  scored on, or without any changes, that row itself, on the splits it lacks."""
  label = FLAGS.rescore
  if FLAGS.splits == []:  # pylint: disable=use-implicit-booleaness-not-comparison
    raise SystemExit(f'--rescore={label}: --splits is empty: name the splits to score '
                     f'({", ".join(SPLITS)}), or leave it out')
  with open(os.path.join(FLAGS.output, 'multi30k.json')) as f:
    rows = json.load(f)
  if label not in rows:
    raise SystemExit(f'--rescore={label}: no such row in multi30k.json (rows: {", ".join(rows)})')
  row = rows[label]
  if changes := decoding():
    splits = splits_or([split for split in SPLITS if split in row['splits']] or ['validation'])
    return workdir_of(label), FLAGS.label, rescored_row(row, changes), splits
  splits = splits_or([split for split in SPLITS if split not in row['splits']])
  if (scored := [split for split in splits if split in row['splits']]) or not splits:
    raise SystemExit(f'--rescore={label}: already scored on {", ".join(scored or row["splits"])}; '
                     'give --splits it lacks, or --average_last=N, --beam_size=B or --alpha=A to '
                     'score it another way')
  return workdir_of(label), label, row, splits


def splits_or(default: list[str]) -> list[str]:
  """--splits where given (an empty list included), else `default`."""
  return default if FLAGS.splits is None else FLAGS.splits


def decoding() -> dict:
  """The decoding flags given, eval.py's names to their values: those a rescore changes."""
  return {name: getattr(FLAGS, name) for name in DECODING if getattr(FLAGS, name) is not None}


def rescored_row(row: dict, changes: dict) -> dict:
  """`row`'s training fields and machine, its overrides followed by `changes` (which replace an
  override of the same key)."""
  kept = [o for o in row['overrides'] if o.split('=', 1)[0] not in changes]  # replaced, not twice
  trained = {key: row[key] for key in ('steps', 'train_minutes', 'config', 'machine')
             if key in row}  # rows written before rows kept their config have none
  return {'pair': row['pair'], 'overrides': kept + [f'{k}={v}' for k, v in changes.items()],
          **trained}


def stated_config(row: dict) -> dict:
  """The config a row states, flattened: today's `configs/multi30k.py:<pair>` with the row's
  overrides, parsed as train.py parses its --config.key=value. An override of a key since removed
  states nothing."""
  keys = traverse_util.flatten_dict(multi30k.get_config(row['pair']).to_dict(), sep='.')
  argv = ['reproduce_multi30k', f'--config={ROOT}/configs/multi30k.py:{row["pair"]}',
          *(f'--config.{o}' for o in row['overrides'] if o.split('=', 1)[0] in keys)]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  return traverse_util.flatten_dict(flag_values.config.to_dict(), sep='.')


def unstated_training(row: dict) -> dict:
  """Where a row's kept config and the config it states differ, key to (trained, stated); decoding,
  which a rescored row changes, and keys added or removed since are left out. Empty for rows
  written before rows kept their config."""
  if 'config' not in row:
    return {}
  stated, trained = stated_config(row), traverse_util.flatten_dict(row['config'], sep='.')
  shared = (stated.keys() & trained.keys()) - set(DECODING)
  return {key: (trained[key], stated[key]) for key in sorted(shared) if trained[key] != stated[key]}


def main(argv):
  del argv
  if decoding() and not FLAGS.rescore:
    raise SystemExit('--average_last, --beam_size and --alpha rescore a row (--rescore=LABEL); '
                     'a new run takes them as --override=key=value')
  code = commit(ROOT)  # the checkout may move on while train.py runs
  if FLAGS.rescore:
    workdir, label, row, splits = rescored()
  else:
    (workdir, row), label, splits = train(), FLAGS.label, splits_or(list(SPLITS))
  row.setdefault('splits', {})
  row.setdefault('commit', code)  # a row scored on more splits keeps the commit it trained
  row.setdefault('machine', machine())  # where the training minutes were measured
  stated = stated_config(row)
  for split in splits:
    output_dir = os.path.join(workdir, f'eval_{label}_{split}')
    run('eval.py', f'--workdir={workdir}', f'--split={split}', f'--output_dir={output_dir}',
        *(f'--{name}={stated[name]}' for name in DECODING))
    with open(os.path.join(output_dir, 'scores.json')) as f:
      row['splits'][split] = json.load(f)

  add_row(FLAGS.output, 'multi30k', label, row, markdown)


def overrides_text(overrides: list[str]) -> str:
  return ' '.join(overrides) or '(the recipe)'


def seed_of(row: dict) -> int:
  """The seed a row trained with: its `seed=N` override, else the config's 0."""
  seeds = [int(o.split('=', 1)[1]) for o in row['overrides'] if o.startswith('seed=')]
  return seeds[-1] if seeds else 0


def but_the_seed(row: dict) -> list[str]:
  """A row's overrides without its seed: what its run shares with its other seeds."""
  return [o for o in row['overrides'] if not o.startswith('seed=')]


def seed_groups(rows: dict, min_seeds: int = 2) -> list[list[dict]]:
  """Rows scored on test that differ only in their seed, on one kind of machine: one list per
  configuration with `min_seeds` seeds or more, in the order of their first row. A seed run twice
  counts once, its latest row."""
  groups = {}
  for r in rows.values():
    if 'test' in r['splits']:
      key = (r['pair'], tuple(but_the_seed(r)), machine_name(r['machine']))
      groups.setdefault(key, {})[seed_of(r)] = r
  return [list(group.values()) for group in groups.values() if len(group) >= min_seeds]


def over_seeds(group: list[dict], split: str, metric: str = 'sacrebleu') -> str:
  """'mean (lowest-highest)' of a split's metric over a seed group, a single row's value alone;
  '-' unless each row has it."""
  values = [r['splits'].get(split, {}).get(metric) for r in group]
  if None in values:
    return '-'
  mean = f'{statistics.mean(values):.2f}'
  return mean if len(values) == 1 else f'{mean} ({min(values):.2f}-{max(values):.2f})'


def lowercased(scores: dict) -> str:
  """The lowercased BLEU of a split's scores; '-' for rows scored before eval.py gave it."""
  return f'{scores["bleu_lowercased"]:.2f}' if 'bleu_lowercased' in scores else '-'


def markdown(rows: dict) -> str:
  lines = [
      'configs/multi30k.py trained from scratch by train.py (minutes: the whole command), then '
      'eval.py: beam search and checkpoint averaging as the config says; test2016 is the test '
      'split. Paper BLEU: tokenized and compound-split, as the paper reports; lowercased BLEU: '
      'lowercased and tokenized, as papers on Multi30k report. Every run scored on '
      'test, the recipe first; the overrides of the others turn the config of today into the one '
      'they ran.',
      '',
      '| pair | config overrides | split | sacreBLEU | paper BLEU | lowercased BLEU | steps | '
      'training minutes | eval sentences/s | checkpoints averaged | machine | commit |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  tested = [r for r in rows.values() if 'test' in r['splits']]
  for r in sorted(tested, key=lambda r: bool(but_the_seed(r))):  # stable: the recipe first
    for split, s in r['splits'].items():
      lines.append(
          f'| {r["pair"]} | {overrides_text(r["overrides"])} | {split} | '
          f'{s["sacrebleu"]:.2f} | {s["bleu_paper"]:.2f} | {lowercased(s)} | {r["steps"]} | '
          f'{r["train_minutes"]:.1f} | {s["sentences_per_sec"]:.1f} | {s["checkpoint_steps"]} | '
          f'{machine_name(r["machine"])} | {r["commit"]} |')
  lines += ['', 'Runs that differ only in their seed: the mean and, in brackets, the lowest and '
            'highest.', '', '| pair | config overrides | seeds | test sacreBLEU | test lowercased '
            'BLEU | validation sacreBLEU | training minutes | machine |',
            '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for group in sorted(seed_groups(rows), key=lambda g: bool(but_the_seed(g[0]))):  # recipe first
    first = group[0]
    minutes = statistics.mean(r['train_minutes'] for r in group)
    lines.append(f'| {first["pair"]} | {overrides_text(but_the_seed(first))} | '
                 f'{", ".join(str(seed_of(r)) for r in group)} | {over_seeds(group, "test")} | '
                 f'{over_seeds(group, "test", "bleu_lowercased")} | '
                 f'{over_seeds(group, "validation")} | {minutes:.1f} | '
                 f'{machine_name(first["machine"])} |')
  lines += ['', 'Variants tried, beside the recipe (validation BLEU: the recipe is chosen on it):',
            '', '| variant | pair | config overrides | steps | training minutes | validation '
            'sacreBLEU | paper BLEU | lowercased BLEU | machine |',
            '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  for label, r in rows.items():
    if 'validation' in r['splits']:
      s = r['splits']['validation']
      lines.append(f'| {label} | {r["pair"]} | {overrides_text(r["overrides"])} | '
                   f'{r["steps"]} | {r["train_minutes"]:.1f} | {s["sacrebleu"]:.2f} | '
                   f'{s["bleu_paper"]:.2f} | {lowercased(s)} | {machine_name(r["machine"])} |')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  flags.DEFINE_string('pair', 'en-de', 'configs/multi30k.py argument: the language pair.')
  flags.DEFINE_string('label', 'recipe', 'Name of this run in the results.')
  flags.DEFINE_string('workdir', None, 'New train.py workdir (default: runs/reproduce/<label>).')
  flags.DEFINE_multi_string('override', [],
                            'key=value: a config key given to train.py (repeatable).')
  flags.DEFINE_list('splits', None, 'Splits eval.py scores (default: validation and test for a '
                    'new run; for --rescore=LABEL, as the module docstring says).')
  flags.DEFINE_string('rescore', None, 'Train nothing: score the run of this row again.')
  flags.DEFINE_integer('average_last', None, "eval.py's --average_last (default: the config's).")
  flags.DEFINE_integer('beam_size', None, "eval.py's --beam_size (default: the config's).")
  flags.DEFINE_float('alpha', None, "eval.py's --alpha (default: the config's).")
  flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                      'Where multi30k.json and multi30k.md go.')
  app.run(main)
