r"""Where the training step's time goes: a jax.profiler trace read against XLA's optimized HLO.

  python -m benchmarks.profile_step [--size=multi30k|base] [--variant='key=value ...']
      [--shape=128x32] [--steps=5] [--top=12] [--name=profile_step]

Runs our pmapped train step (configs/multi30k.py's model or the paper's base of
configs/default.py, with the variant's config overrides; the random batch of vs_flax.py) under
`jax.profiler.trace` and adds up the time of each XLA operation (thunk) the trace records. Each
operation is classed by what its HLO computes, read from the step's optimized HLO:
matmul (a fusion around a dot), reduction (softmax, LayerNorm, loss sums), layout (copy,
transpose), elementwise (any other fusion), other. Prints the classes' shares, the heaviest
operations with the jax op that made them, and the model FLOP/s of the step and of its matmuls
alone (6 FLOPs per parameter and real token, over matmul time) beside the matmul peak of
measure.py in the model's dtype. Writes benchmarks/results/<name>.{json,md}.
"""

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks.measure import machine, machine_name, matmul_peak, write_results
from benchmarks.workload import (CONFIG_FILES, Ours, import_ours, load_config, parse_shape,
                                 random_batch)

_SHAPE = flags.DEFINE_string('shape', '128x32', 'Training batch, rows x length.')
_STEPS = flags.DEFINE_integer('steps', 5, 'Steps traced.')
_TOP = flags.DEFINE_integer('top', 12, 'Heaviest operations listed.')
_SIZE = flags.DEFINE_enum('size', 'multi30k', list(CONFIG_FILES), 'The model\'s config.')
_VARIANT = flags.DEFINE_string('variant', '', 'Space-separated key=value config overrides.')
_NAME = flags.DEFINE_string('name', 'profile_step', 'Results go to <name>.json and <name>.md.')
_OUTPUT = flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                              'Where the results go.')

_COMPUTATION = re.compile(r'^%?(\S+) .*\{$')
_INSTRUCTION = re.compile(r'^\s+(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_classes(hlo: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (class, jax op name)} for the instructions of an optimized HLO module."""
  bodies, current = collections.defaultdict(list), None
  for line in hlo.splitlines():
    if (match := _COMPUTATION.match(line)) and not line.startswith(' '):
      current = match.group(1)
    elif current and (match := _INSTRUCTION.match(line)):
      bodies[current].append((match.group(1), match.group(2), line))

  def lines(computation: str, seen=()) -> list[tuple[str, str]]:
    """(opcode, line) of a computation's instructions and of those of the computations it calls."""
    found = []
    for _, opcode, line in bodies.get(computation, ()):
      found.append((opcode, line))
      for callee in re.findall(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)', line):
        if callee not in seen:
          found += lines(callee, (*seen, computation))
    return found

  classes = {}
  for computation, instructions in bodies.items():
    for name, opcode, line in instructions:
      called = re.findall(r'calls=%?([\w.\-]+)', line)
      body = [pair for c in called for pair in lines(c)] or [(opcode, line)]
      inside = {op for op, _ in body}
      computed = inside - {'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast'}
      dots = [text for op, text in body if op in ('dot', 'convolution')]
      op_name = _OP_NAME.search(dots[0] if dots else line)  # a matmul is named by its dot
      if dots:
        kind = 'matmul'
      elif computed & {'reduce', 'reduce-window'}:
        kind = 'reduction'
      elif computed <= {'copy', 'transpose'} and (computed or 'bitcast' in inside):
        kind = 'layout'
      elif called:
        kind = 'elementwise'
      else:
        kind = 'other'
      classes.setdefault(name, (kind, op_name.group(1) if op_name else ''))
  return classes


def thunk_seconds(trace_dir: str, names: set[str]) -> dict[str, float]:
  """Seconds per HLO instruction name over the trace's complete events."""
  (path,) = glob.glob(os.path.join(trace_dir, '**', 'perfetto_trace.json.gz'), recursive=True)
  with gzip.open(path) as f:
    events = json.load(f)
  events = events['traceEvents'] if isinstance(events, dict) else events
  seconds = collections.Counter()
  for event in events:
    if 'dur' in event and event.get('name') in names:
      seconds[event['name']] += event['dur'] * 1e-6
  return dict(seconds)


def main(argv):
  del argv
  ours = Ours(import_ours(''), load_config(_VARIANT.value, _SIZE.value))
  batch = random_batch(np.random.default_rng(0), *parse_shape(_SHAPE.value),
                       ours.model_config.vocab_size)
  sharded = jax.tree_util.tree_map(lambda x: x[None], batch)
  for _ in range(2):  # compile, and a first step off the clock
    ours.train(sharded)
  with tempfile.TemporaryDirectory() as trace_dir:
    began = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(_STEPS.value):
        ours.train(sharded)
    step_secs = (time.perf_counter() - began) / _STEPS.value  # the tracer's overhead included
    classes = hlo_classes(ours.p_train_step.lower(ours.state, sharded).compile().as_text())
    seconds = {name: s / _STEPS.value
               for name, s in thunk_seconds(trace_dir, set(classes)).items()}
  total = sum(seconds.values())
  by_class = collections.Counter()
  for name, s in seconds.items():
    by_class[classes[name][0]] += s
  encoder_params, decoder_params = ours.parameters
  flops = 6 * (encoder_params * (batch['sources'] > 0).sum() +
               decoder_params * (batch['targets'] > 0).sum())
  results = {
      'shape': _SHAPE.value, 'steps': _STEPS.value, 'step_secs': step_secs,
      'operation_secs': total, 'model_flops_per_sec': float(flops / step_secs),
      'matmul_model_flops_per_sec': float(flops / by_class['matmul']),
      'matmul_peak_flops_per_sec': matmul_peak(5, ours.model_config.dtype)['flops_per_sec'],
      'size': _SIZE.value, 'variant': _VARIANT.value,
      'classes': {kind: {'secs': s, 'share': s / total} for kind, s in by_class.most_common()},
      'top': [{'name': name, 'class': classes[name][0], 'op': classes[name][1], 'secs': s,
               'share': s / total}
              for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:_TOP.value]],
      'machine': machine()}
  table = markdown(results)
  write_results(_OUTPUT.value, _NAME.value, results, table)


def markdown(r: dict) -> str:
  peak = r['matmul_peak_flops_per_sec']
  lines = [
      f'Train step {r["shape"]}, {r.get("size", "multi30k")} size '
      f'{r.get("variant") or ""}, on {machine_name(r["machine"])}: '
      f'{r["step_secs"]:.3f} s per step under the tracer, {r["operation_secs"]:.3f} s of XLA '
      f'operations. Model FLOP/s: {r["model_flops_per_sec"] / 1e12:.3f} TFLOP/s for the step '
      f'({100 * r["model_flops_per_sec"] / peak:.0f}% of the {peak / 1e12:.3f} TFLOP/s matmul '
      f'peak), {r["matmul_model_flops_per_sec"] / 1e12:.3f} TFLOP/s over matmul time alone '
      f'({100 * r["matmul_model_flops_per_sec"] / peak:.0f}%).',
      '',
      '| class | s per step | share |',
      '| --- | --- | --- |']
  lines += [f'| {kind} | {c["secs"]:.3f} | {100 * c["share"]:.0f}% |'
            for kind, c in r['classes'].items()]
  lines += ['', '| operation | class | made by | s per step | share |',
            '| --- | --- | --- | --- | --- |']
  lines += [f'| {t["name"]} | {t["class"]} | `{t["op"]}` | {t["secs"]:.4f} | '
            f'{100 * t["share"]:.1f}% |' for t in r['top']]
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  app.run(main)
