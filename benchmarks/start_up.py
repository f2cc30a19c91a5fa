r"""How long train.py takes from its launch to its first log line, its first log row of training
and its last checkpoint.

  python -m benchmarks.start_up --manual_dir=../shared/data/multi30k [--label=NAME]
      [--config=configs/multi30k.py] [--checkout=DIR] [--fresh_data] [--steps=N]
      [--override=key=value ...] [--workdir=DIR] [--run_to_exit] [--parts]

Runs the checkout's train.py in a new workdir, then stops it with a SIGTERM, as a preemption
would, once its closing BLEU translates, and notes the seconds to its exit (Cloud TPU leaves a
preempted VM ~30 s); --run_to_exit lets it finish. --fresh_data prepares the data and vocabulary
in a new TFDS directory; --parts first times what comes before the first log line. Adds a row
under --label to benchmarks/results/start_up.{json,md}.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.measure import add_row, commit, machine, machine_name
from benchmarks.reproduce_multi30k import MANUAL_DIR

_CHECKOUT = flags.DEFINE_string('checkout', os.path.dirname(os.path.dirname(__file__)),
                                'The repository checkout whose train.py runs.')
_CONFIG = flags.DEFINE_string('config', 'configs/multi30k.py', 'The config, in the checkout.')
_LABEL = flags.DEFINE_string('label', 'current', 'Name of this measurement in the results.')
_STEPS = flags.DEFINE_integer('steps', 0, 'config.num_train_steps; 0 keeps the config\'s.')
_FRESH_DATA = flags.DEFINE_bool('fresh_data', False,
                                'Prepare the data and train the vocabulary anew, in a new TFDS '
                                'directory.')
_OVERRIDES = flags.DEFINE_multi_string('override', [],
                                       'key=value: a config key given to train.py (repeatable).')
_WORKDIR = flags.DEFINE_string('workdir', '', 'The run\'s workdir (kept); default: a temporary '
                               'one.')
_RUN_TO_EXIT = flags.DEFINE_bool('run_to_exit', False, 'Let train.py finish; note its exit.')
_PARTS = flags.DEFINE_bool('parts', False, 'Also time, in a fresh interpreter first, what comes '
                           'before train.py\'s first log line: its imports, jax.distributed\'s '
                           'look for a cluster and the backend\'s start.')
_OUTPUT = flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                              'Where start_up.json and start_up.md go.')

MILESTONES = ('first_log_line', 'first_training_row', 'last_checkpoint', 'exit',
              'sigterm_to_exit')
PARTS = ('interpreter', 'imports', 'cluster_lookup', 'backend')  # before the first log line
POLL_SECS = 0.02


# What train.py does before it logs, each part timed: its imports, initialize_distributed (which
# logs the first line) and the backend's start (its first log line comes before, or just after).
_PARTS_CODE = """
import json, time
began = time.perf_counter()
import train
imported = time.perf_counter()
import jax
try:
  jax.distributed.initialize()
except (ValueError, RuntimeError):
  pass
looked = time.perf_counter()
jax.devices()
print(json.dumps({'imports': imported - began, 'cluster_lookup': looked - imported,
                  'backend': time.perf_counter() - looked}))
"""


def before_first_log_line(checkout: str) -> dict:
  """Seconds of the interpreter's start, train.py's imports, jax.distributed's look for a
  cluster and the backend's start, in a fresh interpreter."""
  began = time.perf_counter()
  result = subprocess.run([sys.executable, '-c', _PARTS_CODE], cwd=checkout, check=True,
                          capture_output=True, text=True)
  parts = json.loads(result.stdout.splitlines()[-1])
  parts['interpreter'] = time.perf_counter() - began - sum(parts.values())
  return {name: round(parts[name], 2) for name in PARTS}


def closing_bleu_began(log_path: str) -> bool:
  """Whether train.py's log says its closing BLEU is translating."""
  with open(log_path) as f:
    return any('translating' in line for line in f)


def first_training_row(metrics_path: str) -> bool:
  if not os.path.exists(metrics_path):
    return False
  with open(metrics_path) as f:
    return any('split' not in json.loads(line) for line in f if line.endswith('\n'))


def measure(workdir: str, tfds_dir: str | None) -> dict:
  """The milestones' seconds from the launch of train.py in `workdir`."""
  checkout = os.path.abspath(_CHECKOUT.value)
  args = [f'--config={_CONFIG.value}', f'--workdir={workdir}',
          *(f'--config.{o}' for o in _OVERRIDES.value)]
  if _STEPS.value:
    args.append(f'--config.num_train_steps={_STEPS.value}')
  if tfds_dir:
    args.append(f'--config.tfds_data_dir={tfds_dir}')
  if MANUAL_DIR.value and 'multi30k' in _CONFIG.value:
    args.append(f'--config.manual_dir={os.path.abspath(MANUAL_DIR.value)}')
  last = None  # the last checkpoint's directory (Orbax makes it whole), named by config.json
  config_path, log_path = os.path.join(workdir, 'config.json'), os.path.join(workdir, 'train.log')
  os.makedirs(workdir, exist_ok=True)
  seen = {}
  with open(log_path, 'w') as log:
    began = time.perf_counter()
    process = subprocess.Popen([sys.executable, 'train.py', *args], cwd=checkout, stdout=log,
                               stderr=subprocess.STDOUT)
    while process.poll() is None:
      now = time.perf_counter() - began
      if 'first_log_line' not in seen and os.path.getsize(log_path):
        with open(log_path) as f:
          if any(line[:1] in 'IWE' and line[1:5].isdigit() for line in f):
            seen['first_log_line'] = now
      if 'first_training_row' not in seen and first_training_row(
          os.path.join(workdir, 'metrics.jsonl')):
        seen['first_training_row'] = now
      if last is None and os.path.exists(config_path):  # written before the data and checkpoints
        with open(config_path) as f:
          last = os.path.join(workdir, 'checkpoints', str(json.load(f)['num_train_steps']))
      if 'last_checkpoint' not in seen and last and os.path.isdir(last):
        seen['last_checkpoint'] = now
      if ('last_checkpoint' in seen and not _RUN_TO_EXIT.value and
          closing_bleu_began(log_path)):
        process.terminate()  # a preemption: train.py stops its closing BLEU
        signalled = time.perf_counter()
        try:
          process.wait(timeout=60)
          seen['sigterm_to_exit'] = time.perf_counter() - signalled
        except subprocess.TimeoutExpired:
          process.kill()
          process.wait()
        break
      time.sleep(POLL_SECS)
    else:
      seen['exit'] = time.perf_counter() - began
  if 'last_checkpoint' not in seen or process.returncode:
    with open(log_path) as f:
      tail = f.read()[-3000:]
    raise SystemExit(f'train.py failed (exit code {process.returncode}; last checkpoint {last} '
                     f'{"written" if "last_checkpoint" in seen else "missing"}); its log ends:\n'
                     f'{tail}')
  return {name: round(seen[name], 2) for name in MILESTONES if name in seen}


def markdown(rows: dict) -> str:
  lines = ['Seconds from the launch of train.py (`python -m benchmarks.start_up`). With --parts, '
           'what comes before its first log line, timed in a fresh interpreter: '
           f'{", ".join(PARTS)}.', '',
           '| label | commit | config | fresh data | ' + ' | '.join(MILESTONES) +
           ' | before the first log line | machine |',
           '| --- ' * (len(MILESTONES) + 6) + '|']
  for label, row in rows.items():
    cells = [str(row['milestones'].get(name, '-')) for name in MILESTONES]
    parts = row.get('parts')
    lines.append(f'| {label} | {row["commit"]} | {row["config"]} {" ".join(row["overrides"])} | '
                 f'{"yes" if row["fresh_data"] else "no"} | {" | ".join(cells)} | '
                 f'{" + ".join(str(parts[name]) for name in PARTS) if parts else "-"} | '
                 f'{machine_name(row["machine"])} |')
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  parts = before_first_log_line(os.path.abspath(_CHECKOUT.value)) if _PARTS.value else None
  with tempfile.TemporaryDirectory() as tmp:
    workdir = _WORKDIR.value or os.path.join(tmp, 'workdir')
    milestones = measure(workdir, os.path.join(tmp, 'tfds') if _FRESH_DATA.value else None)
  row = {'commit': commit(_CHECKOUT.value), 'config': _CONFIG.value,
         'overrides': _OVERRIDES.value + ([f'num_train_steps={_STEPS.value}'] if _STEPS.value
                                          else []),
         'fresh_data': _FRESH_DATA.value, 'milestones': milestones, 'machine': machine()}
  if parts:
    row['parts'] = parts
  add_row(_OUTPUT.value, 'start_up', _LABEL.value, row, markdown)


if __name__ == '__main__':
  app.run(main)
