r"""Where the training step's time goes: a jax.profiler trace read against XLA's optimized HLO.

  python -m benchmarks.profile_step [--size=multi30k|base] [--variant='key=value ...']
      [--side=ours|flax] [--shape=128x32] [--packed] [--steps=5] [--top=12] [--name=profile_step]

Traces --steps of our pmapped train step (--size's config with every --variant's overrides;
vs_flax.py's random batch, or with --packed one packed as train.py's, `workload.packed_batch`),
or with --side=flax flax examples/wmt's, and sums each XLA operation's time: a CPU's thunks, or
an accelerator's kernels by the operation that launched them, classed by what its HLO computes
(matmul, reduction, layout, elementwise, other: `hlo.hlo_classes`). Prints the classes' shares,
the heaviest operations and jax ops (every layer's summed), the model FLOP/s (6 per parameter and
real token) of the step and over matmul time beside measure.py's matmul peak, and on an
accelerator how busy its timeline was (`device_timeline`). Writes
benchmarks/results/<name>.{json,md}.
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

from benchmarks.hlo import hlo_classes
from benchmarks.measure import machine, machine_name, matmul_peak, write_results
from benchmarks.workload import (Flax, Ours, define_workload_flags, fetch_flax_examples,
                                 load_config, packed_batch, parse_shape, random_batch)
from transformer import metrics


def operation_seconds(path: str, names: set[str]) -> tuple[dict[str, float], dict[str, int]]:
  """Seconds and events per HLO instruction name over a trace's complete events.

  An accelerator's kernels are counted on its own timeline, and the host's events of the same
  operations (their launches) are left out. A kernel is named by the HLO operation that launched
  it: its kernel name where that is an operation's name with '.' and '-' as '_' (a fusion), else
  its `hlo_op` (outside a CUDA graph, whose kernels all have the graph's), else its own name (a
  library's matmul in a graph). On a CPU the thunks are the host's events.
  """
  events, devices = _trace_events(path)
  kernel_names = {re.sub(r'[.\-]', '_', name): name for name in names}
  seconds, counts = collections.Counter(), collections.Counter()
  for event in events:
    if 'dur' not in event or (devices and event.get('pid') not in devices):
      continue
    kernel, op = event.get('name'), event.get('args', {}).get('hlo_op')
    name = next((n for n in (kernel_names.get(kernel), kernel, op) if n in names), kernel)
    if name in names or devices:
      seconds[name] += event['dur'] * 1e-6
      counts[name] += 1
  return dict(seconds), dict(counts)


def _trace_events(path: str) -> tuple[list[dict], set[int]]:
  """A trace's events, and the process ids of its accelerators' timelines."""
  with gzip.open(path) as f:
    events = json.load(f)
  events = events['traceEvents'] if isinstance(events, dict) else events
  processes = {e['pid']: e.get('args', {}).get('name', '') for e in events
               if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  return events, {pid for pid, name in processes.items()
                  if re.search(r'/device:(GPU|TPU)', name)}


def device_timeline(path: str, steps: int) -> dict | None:
  """When the accelerator computed, per step: `busy_secs` (its kernels, overlaps counted once;
  copies left out), `span_secs` (from a step's first kernel to its last) and `between_steps_secs`
  (idle between one step's last kernel and the next's first: the host's share when each step is
  waited for, as here). The `steps - 1` longest idle gaps are taken as the steps' boundaries.
  None without an accelerator's timeline (a CPU's)."""
  events, devices = _trace_events(path)
  # Copies (the next batch's upload) run on streams of their own, beside the computation.
  intervals = sorted((e['ts'], e['ts'] + e['dur']) for e in events
                     if 'dur' in e and e.get('pid') in devices and
                     not e.get('name', '').startswith('Memcpy'))
  if not intervals:
    return None
  merged = [list(intervals[0])]
  for start, end in intervals[1:]:
    if start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  gaps = sorted((b[0] - a[1] for a, b in zip(merged, merged[1:])), reverse=True)
  between = gaps[:steps - 1]
  whole = merged[-1][1] - merged[0][0]
  to_secs = lambda micros: micros * 1e-6 / steps
  return {'busy_secs': to_secs(sum(end - start for start, end in merged)),
          'span_secs': to_secs(whole - sum(between)),
          'between_steps_secs': sum(between) * 1e-6 / max(len(between), 1)}


def library_class(kernel: str) -> tuple[str, str]:
  """The class of a kernel no HLO operation names: cuBLAS's and CUTLASS's matmuls, or unknown."""
  if re.search(r'gemm|nvjet|xmma|cutlass|cublas', kernel):
    return 'matmul', 'a matmul library kernel'
  if 'cudnn' in kernel:  # in our steps, the attention's
    return 'unknown', 'a cuDNN kernel'
  return 'unknown', ''


def main(argv):
  del argv
  results = measure()
  write_results(_OUTPUT.value, _NAME.value, results, markdown(results))


def measure() -> dict:
  """Traces --steps train steps and sums up the trace."""
  variant = ' '.join(_VARIANTS.value)
  ours = Ours(load_config(variant, _SIZE.value))
  make_batch = packed_batch if _PACKED.value else random_batch
  batch = make_batch(np.random.default_rng(0), *parse_shape(_SHAPE.value),
                     ours.model_config.vocab_size)
  sharded = jax.tree_util.tree_map(lambda x: x[None], batch)
  side = ours if _SIDE.value == 'ours' else Flax(fetch_flax_examples(_FLAX_DIR.value), ours)
  for _ in range(2):  # compile, and a first step off the clock
    side.train(sharded)
  flops = metrics.model_flops(ours.parameters, (batch['sources'] > 0).sum(),
                              (batch['targets'] > 0).sum())
  with tempfile.TemporaryDirectory() as trace_dir:
    began = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(_STEPS.value):
        side.train(sharded)
    step_secs = (time.perf_counter() - began) / _STEPS.value  # the tracer's overhead included
    hlo = side.train_hlo(sharded)
    (trace,) = glob.glob(os.path.join(trace_dir, '**', 'perfetto_trace.json.gz'), recursive=True)
    results = summary(trace, hlo, _STEPS.value, _TOP.value, float(flops))
  return {
      'shape': _SHAPE.value + (' packed' if _PACKED.value else ''), 'steps': _STEPS.value,
      'step_secs': step_secs,
      'model_flops_per_sec': float(flops / step_secs),
      'matmul_peak_flops_per_sec': matmul_peak(5, ours.model_config.dtype)['flops_per_sec'],
      'size': _SIZE.value, 'variant': variant, 'side': _SIDE.value,
      'machine': machine(), **results}


def summary(trace: str, hlo: str, steps: int, top: int, flops: float) -> dict:
  """The trace's operation time per step, by class and for the `top` heaviest operations."""
  classes = hlo_classes(hlo)
  seconds, counts = operation_seconds(trace, set(classes))
  seconds = {name: s / steps for name, s in seconds.items()}
  classes = {name: classes.get(name) or library_class(name) for name in seconds}
  total = sum(seconds.values())
  by_class, launches = collections.Counter(), collections.Counter()
  by_op, op_launches = collections.Counter(), collections.Counter()
  for name, s in seconds.items():
    by_class[classes[name][0]] += s
    launches[classes[name][0]] += counts[name] / steps
    op = (classes[name][0], re.sub(r'layer_\d+', 'layer_N', classes[name][1]))
    by_op[op] += s
    op_launches[op] += counts[name] / steps
  return {
      'device_timeline': device_timeline(trace, steps),
      'operation_secs': total,
      'operation_model_flops_per_sec': flops / total,
      'matmul_model_flops_per_sec': flops / max(by_class['matmul'], 1e-9),
      'classes': {kind: {'secs': s, 'share': s / total, 'launches': launches[kind]}
                  for kind, s in by_class.most_common()},
      'top': [{'name': name, 'class': classes[name][0], 'op': classes[name][1], 'secs': s,
               'share': s / total}
              for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]],
      'top_ops': [{'op': op, 'class': kind, 'secs': s, 'share': s / total,
                   'operations': op_launches[kind, op]}
                  for (kind, op), s in by_op.most_common(top)]}


def markdown(r: dict) -> str:
  peak = r['matmul_peak_flops_per_sec']
  rate = lambda flops: f'{flops / 1e12:.3f} TFLOP/s ({100 * flops / peak:.0f}%)'
  lines = [
      f'{"flax examples/wmt" if r.get("side") == "flax" else "Our"} train step {r["shape"]}, '
      f'{r.get("size", "multi30k")} size{" " + r["variant"] if r.get("variant") else ""}, on '
      f'{machine_name(r["machine"])}: '
      f'{r["step_secs"]:.3f} s per step under the tracer, {r["operation_secs"]:.4f} s of XLA '
      f'operations. Model FLOP/s (% of the {peak / 1e12:.3f} TFLOP/s matmul peak): '
      f'{rate(r["model_flops_per_sec"])} for the step under the tracer, '
      + (f'{rate(r["operation_model_flops_per_sec"])} over the operations\' time, '
         if 'operation_model_flops_per_sec' in r else '')
      + f'{rate(r["matmul_model_flops_per_sec"])} over matmul time alone.'
      + (' On the accelerator\'s timeline, per step: {busy_secs:.4f} s busy in a span of '
         '{span_secs:.4f} s from its first kernel to its last, and {between_steps_secs:.4f} s '
         'idle between steps (each step waited for before the next is launched).'
         .format(**r['device_timeline']) if r.get('device_timeline') else ''),
      '',
      '| class | s per step | share | operations per step |',
      '| --- | --- | --- | --- |']
  lines += [f'| {kind} | {c["secs"]:.4f} | {100 * c["share"]:.0f}% | {c.get("launches", 0):.0f} |'
            for kind, c in r['classes'].items()]
  lines += ['', '| operation | class | made by | s per step | share |',
            '| --- | --- | --- | --- | --- |']
  lines += [f'| {t["name"]} | {t["class"]} | `{t["op"]}` | {t["secs"]:.4f} | '
            f'{100 * t["share"]:.1f}% |' for t in r['top']]
  if 'top_ops' in r:
    lines += ['', "| jax op (every layer's) | class | s per step | share | operations per step |",
              '| --- | --- | --- | --- | --- |']
    lines += [f'| `{t["op"]}` | {t["class"]} | {t["secs"]:.4f} | {100 * t["share"]:.1f}% | '
              f'{t["operations"]:.0f} |' for t in r['top_ops']]
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':  # flags here: the tests import the module beside other benchmarks
  _SIZE, _VARIANTS, _FLAX_DIR, _NAME, _OUTPUT, _SHAPE, _PACKED = define_workload_flags(
      'profile_step', 'all of them together', shape='128x32')
  _STEPS = flags.DEFINE_integer('steps', 5, 'Steps traced.')
  _TOP = flags.DEFINE_integer('top', 12, 'Heaviest operations listed.')
  _SIDE = flags.DEFINE_enum('side', 'ours', ['ours', 'flax'], 'Whose train step is traced.')
  app.run(main)
