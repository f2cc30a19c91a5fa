r"""End to end on Multi30k EN->DE: train.py's speed after compilation, then eval.py's on test2016.

  python -m benchmarks.end_to_end --manual_dir=../shared/data/multi30k [--label=after]
      [--checkout=DIR] [--steps=300] [--log_every=50] [--override=packing=False ...]

Runs `train.py --config=configs/multi30k.py` for --steps steps (no evaluation or checkpoint on the
way) and reads its metrics.jsonl: real target tokens/s and model FLOP/s (train.py's own count:
6 FLOPs per parameter and real token) over the log intervals after the first, whose steps compile
one program per padded length. Then `eval.py` translates test2016 (1000 sentences, beam 4) with
the last checkpoint and reports sentences/s, its compilation included. The matmul peak of
benchmarks/measure.py is measured first, in this process, for the ratio. --checkout runs another
checkout's train.py and eval.py (say, an older commit, for a before/after comparison);
--override passes config keys to train.py (say, packing=False, to measure length buckets).

Adds a row under --label to benchmarks/results/end_to_end.{json,md}.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from benchmarks.multi30k_setup import MANUAL_DIR
from benchmarks.measure import add_row, commit, machine, machine_name, matmul_peak, tflops

_CHECKOUT = flags.DEFINE_string('checkout', os.path.dirname(os.path.dirname(__file__)),
                                'The repository checkout whose train.py and eval.py run.')
_LABEL = flags.DEFINE_string('label', 'current', 'Name of this measurement in the results.')
_STEPS = flags.DEFINE_integer('steps', 300, 'Training steps.')
_LOG_EVERY = flags.DEFINE_integer('log_every', 50, 'Steps per metrics row.')
_OVERRIDES = flags.DEFINE_multi_string('override', [],
                                       'key=value: a config key given to train.py (repeatable).')
_OUTPUT = flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                              'Where end_to_end.json and end_to_end.md go.')


def run(checkout: str, *args: str):
  """Runs a script of `checkout` with this interpreter; its output goes to this one's stderr."""
  subprocess.run([sys.executable, *args], cwd=checkout, check=True, stdout=sys.stderr)


def training_speed(metrics_path: str) -> dict:
  """Real target tokens/s and model FLOP/s over the training rows after the first."""
  with open(metrics_path) as f:
    rows = [row for row in map(json.loads, f) if 'split' not in row]
  timed = rows[1:]
  if not timed:
    raise SystemExit(f'{metrics_path}: fewer than two training rows; raise --steps')
  seconds = sum(row['step_secs'] * _LOG_EVERY.value for row in timed)
  return {
      'steps_timed': len(timed) * _LOG_EVERY.value,
      'step_secs': seconds / (len(timed) * _LOG_EVERY.value),
      'target_tokens_per_sec': sum(row['target_tokens'] for row in timed) / seconds,
      'model_flops_per_sec': sum(row['model_flops_per_sec'] * row['step_secs'] * _LOG_EVERY.value
                                 for row in timed) / seconds,
  }


def main(argv):
  del argv
  checkout = os.path.abspath(_CHECKOUT.value)
  manual_dir = os.path.abspath(MANUAL_DIR.value)
  peak = matmul_peak(repeats=7)['flops_per_sec']
  with tempfile.TemporaryDirectory() as tmp:
    workdir = os.path.join(tmp, 'run')
    run(checkout, 'train.py', '--config=configs/multi30k.py', f'--workdir={workdir}',
        f'--config.manual_dir={manual_dir}', f'--config.tfds_data_dir={tmp}/tfds',
        f'--config.num_train_steps={_STEPS.value}', f'--config.log_every_steps={_LOG_EVERY.value}',
        '--config.eval_every_steps=0', '--config.bleu_every_steps=0',
        '--config.checkpoint_every_steps=0', '--config.checkpoint_every_secs=0',
        *(f'--config.{override}' for override in _OVERRIDES.value))
    result = training_speed(os.path.join(workdir, 'metrics.jsonl'))
    run(checkout, 'eval.py', f'--workdir={workdir}', f'--output_dir={tmp}/eval')
    with open(os.path.join(tmp, 'eval', 'scores.json')) as f:
      scores = json.load(f)
  result.update(
      eval_sentences_per_sec=scores['sentences_per_sec'], eval_sentences=scores['num_sentences'],
      matmul_peak_flops_per_sec=peak, overrides=_OVERRIDES.value,
      commit=commit(checkout), machine=machine())
  add_row(_OUTPUT.value, 'end_to_end', _LABEL.value, result, markdown)


def markdown(results: dict) -> str:
  lines = [
      'train.py on Multi30k EN->DE (configs/multi30k.py) after its first log interval, and eval.py '
      'on test2016 (beam 4), compilation included. Model FLOP/s in brackets: % of the float32 '
      'matmul peak measured in the same run.',
      '',
      '| run | commit | config overrides | train step (s) | real target tokens/s | model TFLOP/s | '
      'eval sentences/s | machine |',
      '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for label, r in results.items():
    lines.append(
        f'| {label} | {r["commit"]} | {" ".join(r.get("overrides", [])) or "-"} | '
        f'{r["step_secs"]:.3f} | {r["target_tokens_per_sec"]:,.0f} | '
        f'{tflops(r["model_flops_per_sec"], r["matmul_peak_flops_per_sec"])} | '
        f'{r["eval_sentences_per_sec"]:.1f} | {machine_name(r["machine"])} |')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  app.run(main)
