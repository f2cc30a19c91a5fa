"""What the speed benchmarks share: timing, the machine's description, its matmul peak, and
writing results."""

import json
import os
import platform
import subprocess
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np

from transformer.files import write_atomically


def round_robin(fns: dict, repeats: int) -> dict:
  """{name: seconds of each call}: `repeats` rounds in which each `fns[name]()` (which waits for
  its result) runs once, the order rotated every round, so a drift of the machine's speed over the
  run (other tenants, clocks) falls on all of them alike within a round."""
  names = list(fns)
  times = {name: [] for name in names}
  for round_ in range(repeats):
    shift = round_ % len(names)
    for name in names[shift:] + names[:shift]:
      began = time.perf_counter()
      fns[name]()
      times[name].append(time.perf_counter() - began)
  return times


def machine() -> dict:
  """CPU model with its widest vector unit, cores, the accelerator if jax uses one, and library
  versions."""
  cpu = platform.processor() or platform.machine()
  if os.path.exists('/proc/cpuinfo'):
    with open('/proc/cpuinfo') as f:
      lines = f.read().splitlines()
    value = lambda key: next((line.split(':', 1)[1].strip() for line in lines
                              if line.startswith(key)), '')
    # The model name alone ('AMD EPYC') can hide a 3x difference in float32 matmul speed.
    flags = value('flags').split()
    vector = next((name for flag, name in (('avx512f', 'AVX-512'), ('avx2', 'AVX2'))
                   if flag in flags), '')
    cpu = (value('model name') or cpu) + (f' ({vector})' if vector else '')
  accelerator = jax.devices()[0].device_kind if jax.default_backend() != 'cpu' else None
  return {'cpu': cpu, 'cores': os.cpu_count(), 'accelerator': accelerator,
          'devices': jax.local_device_count(), 'jax': jax.__version__, 'flax': flax.__version__}


def machine_name(machine: dict) -> str:
  """'2 cores, <cpu>', followed by the accelerator's device count and kind where there is one."""
  name = f'{machine["cores"]} cores, {machine["cpu"]}'
  if machine.get('accelerator'):  # rows measured before this key existed ran on CPUs
    name += f', {machine["devices"]}x {machine["accelerator"]}'
  return name


def sustained_rate(call, repeats: int, warmup_secs: float, batch_secs: float = 0.05,
                   clock=time.perf_counter) -> float:
  """Calls per second of `call()` (which returns an array without waiting for it) run back to
  back: the best of `repeats` batches of calls, each batch waited for once at its end, after
  `warmup_secs` of such batches.

  An idle GPU's clocks rise only after a while under load, and a call waited for alone also
  counts its launch and the wait: timed one waited call at a time, an H100's bfloat16 matmul
  peak read 622-717 TFLOP/s on different machines, and 682 and 713 on one machine minutes apart.
  """
  def batch(calls: int) -> float:
    began = clock()
    for _ in range(calls - 1):
      call()
    call().block_until_ready()
    return clock() - began

  calls, began = 1, clock()
  while batch(calls) < batch_secs:  # enough calls for a batch of batch_secs
    calls *= 2
  while clock() - began < warmup_secs:
    batch(calls)
  return max(calls / batch(calls) for _ in range(repeats))


def matmul_peak(repeats: int, dtype=jnp.float32) -> dict:
  """Best FLOP/s of a jitted square matmul in `dtype` over a few sizes, larger on accelerators,
  each run back to back (`sustained_rate`), after a second of warm-up on an accelerator."""
  best = {'flops_per_sec': 0.0}
  accelerator = jax.default_backend() != 'cpu'
  sizes = (2048, 4096, 8192) if accelerator else (512, 1024, 2048)
  for n in sizes:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()  # compiled
    flops_per_sec = 2 * n**3 * sustained_rate(lambda: matmul(a, a), repeats,
                                              warmup_secs=1.0 if accelerator else 0.0)
    if flops_per_sec > best['flops_per_sec']:
      best = {'flops_per_sec': flops_per_sec, 'size': n}
  return best


def tflops(flops_per_sec: float, peak: float) -> str:
  """'0.123 (45%)': TFLOP/s and the share of the matmul peak."""
  return f'{flops_per_sec / 1e12:.3f} ({100 * flops_per_sec / peak:.0f}%)'


def write_results(directory: str, name: str, results, table: str):
  """Prints the markdown `table`; writes `<name>.json` and `<name>.md` in `directory`."""
  print(table)
  os.makedirs(directory, exist_ok=True)
  write_atomically(os.path.join(directory, f'{name}.json'), json.dumps(results, indent=2) + '\n')
  write_atomically(os.path.join(directory, f'{name}.md'), table)


def add_row(directory: str, name: str, label: str, row: dict, markdown):
  """Puts `row` under `label` in `<name>.json` (other labels' rows stay), then writes the JSON
  and `markdown(all rows)` as `write_results` does."""
  path = os.path.join(directory, f'{name}.json')
  rows = {}
  if os.path.exists(path):
    with open(path) as f:
      rows = json.load(f)
  rows[label] = row
  write_results(directory, name, rows, markdown(rows))


def commit(checkout: str) -> str:
  """The short hash of the checkout's HEAD."""
  return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=checkout, text=True,
                        capture_output=True).stdout.strip()
