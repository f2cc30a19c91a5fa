r"""What running as several hosts costs: train.py's step time and its closing BLEU's wall time on
one process against several local processes with the same devices in all.

  python -m benchmarks.multi_host [--devices=2] [--processes=2] [--steps=200] [--name=multi_host]

Runs configs/tiny.py for --steps steps (no evaluation on the way; checkpoints at the end) as
one process with --devices simulated CPU devices, then as --processes processes with
--devices / --processes each, joined through a local coordinator, once with the hosts agreeing
on preemption every step (`preemption_check_every_steps=1`) and once with the config's default.
Reads each run's metrics.jsonl: the step time of the last log interval, and the seconds from the
last training row to the closing test BLEU row (checkpoint averaging and the validation and test
BLEUs; each host translates its part of every beam-search call). The processes share this
machine's cores, so the figures say what the coordination costs, not what more hosts would gain.
Writes benchmarks/results/<name>.{json,md}.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile

from absl import app, flags

from benchmarks.measure import machine, machine_name, write_results
from configs import tiny

_DEVICES = flags.DEFINE_integer('devices', 2, 'Devices in all.')
_PROCESSES = flags.DEFINE_integer('processes', 2, 'Processes of the multi-host runs.')
_STEPS = flags.DEFINE_integer('steps', 200, 'Training steps of each run.')
_NAME = flags.DEFINE_string('name', 'multi_host', 'Results go to <name>.json and <name>.md.')
_OUTPUT = flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                              'Where the results go.')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(workdir: str, processes: int, overrides: list[str]) -> dict:
  """Trains in `processes` processes; the step time and closing BLEU time of its metrics.jsonl."""
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count='
             f'{_DEVICES.value // processes}')
  command = [sys.executable, 'train.py', '--config=configs/tiny.py', f'--workdir={workdir}',
             f'--config.num_train_steps={_STEPS.value}', '--config.eval_every_steps=0',
             f'--config.log_every_steps={_STEPS.value // 4}', *overrides]
  if processes > 1:
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      port = s.getsockname()[1]
    command += [f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={processes}']
  jobs = [subprocess.Popen(command + ([f'--process_id={i}'] if processes > 1 else []), cwd=ROOT,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
          for i in range(processes)]
  for job in jobs:
    _, stderr = job.communicate(timeout=1800)
    if job.returncode:
      raise SystemExit(f'train.py failed:\n{stderr[-3000:]}')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  last_train = [r for r in rows if 'split' not in r][-1]
  test_bleu = [r for r in rows if r.get('split') == 'test' and 'sacrebleu' in r][-1]
  return {'step_secs': last_train['step_secs'], 'bleu_secs': test_bleu['time'] - last_train['time'],
          'sacrebleu': test_bleu['sacrebleu']}


def main(argv):
  del argv
  check = tiny.get_config().preemption_check_every_steps
  layouts = [(1, []), (_PROCESSES.value, ['--config.preemption_check_every_steps=1']),
             (_PROCESSES.value, [f'--config.preemption_check_every_steps={check}'])]
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for n, (processes, overrides) in enumerate(layouts):
      result = run(os.path.join(tmp, str(n)), processes, overrides)
      rows.append({'processes': processes, 'devices_per_process': _DEVICES.value // processes,
                   'overrides': overrides, **result})
  results = {'steps': _STEPS.value, 'rows': rows, 'machine': machine()}
  write_results(_OUTPUT.value, _NAME.value, results, markdown(results))


def markdown(results: dict) -> str:
  lines = [f'configs/tiny.py, {results["steps"]} steps, on {machine_name(results["machine"])}; '
           'step time of the last log interval, and the closing BLEU (checkpoint averaging, '
           'validation and test) in seconds.', '',
           '| processes x devices | overrides | step (ms) | closing BLEU (s) | test sacreBLEU |',
           '| --- | --- | --- | --- | --- |']
  lines += [f'| {r["processes"]} x {r["devices_per_process"]} | '
            f'{" ".join(r["overrides"]) or "-"} | {1e3 * r["step_secs"]:.1f} | '
            f'{r["bleu_secs"]:.1f} | {r["sacrebleu"]:.2f} |' for r in results['rows']]
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  app.run(main)
