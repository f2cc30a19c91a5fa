r"""Whether a config's programs compile for a Cloud TPU slice and fit its chips' memory, checked on
a machine without a TPU, before renting one.

  pip install -e '.[tpu]'  # libtpu, whose compile-only client needs no TPU
  python -m benchmarks.tpu_plan --config=configs/wmt14.py:big,en-de --topology=v4:2x2x4
      [--config.key=value ...] [--name=NAME]

libtpu compiles for a named slice (`jax.experimental.topologies`), as MaxText's train_compile does.
The programs are train.py's on that slice, pmapped over its devices: the train step (with
grad_accum_steps > 1, its gradient, accumulation and update programs) at the per-device batch
that tokens_per_batch, the device count and grad_accum_steps give; the evaluation step on it;
and beam search at the decode batch (decode_batch_tokens). The implementations are those a TPU
runs (`kernels.choice`): none of the GPU kernels. Train batches are taken at their longest
bucket, `max_length`, with rows full of real tokens: the real batches' padding adds some to the
temporaries. For each program it prints, per device: the parameters and optimizer state, the
temporaries, the total against the device's share of its chip's memory (HBM, below, from
Google's pages), the compiled FLOPs against the model FLOPs train.py logs (6 per parameter and
token), the tokens, the compile seconds and whether it fits. A program that does not fit ends
the command with status 1 and a line saying what to change. --name also writes
benchmarks/results/<name>.{json,md}.
"""

import math
import os
import re
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the only backend this runs on; libtpu compiles
# libtpu otherwise holds a lock file that any other process loading it (a JAX on this machine
# looking for a TPU) makes it fail on; compiling needs no TPU to itself.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from benchmarks.measure import write_results  # noqa: E402
from transformer import commands, decode, model, train_step  # noqa: E402
from transformer import config as config_lib  # noqa: E402
from transformer.data import batching  # noqa: E402
from transformer.kernels import choice, packing  # noqa: E402
from transformer.translate import LENGTH_STEP, decode_batches  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string('topology', None, "A slice's topology, e.g. 'v5e:2x2' (v5e-4), "
                                "'v4:2x2x4' (v4-32), 'v5p:2x2x2', 'v6e:2x4'.")
_NAME = flags.DEFINE_string('name', '', 'Write <results_dir>/<name>.{json,md} too.')
_RESULTS_DIR = flags.DEFINE_string('results_dir', os.path.join(os.path.dirname(__file__),
                                                               'results'), 'Where --name goes.')
flags.mark_flags_as_required(['config', 'topology'])

# A chip's memory: device kind -> (bytes, where Google says so).
HBM = {
    'TPU v4': (32 * 2**30, 'https://cloud.google.com/tpu/docs/v4 (32 GiB)'),
    'TPU v5 lite': (16 * 10**9, 'https://cloud.google.com/tpu/docs/v5e (16 GB)'),
    'TPU v5': (95 * 10**9, 'https://cloud.google.com/tpu/docs/v5p (95 GB)'),
    'TPU v6 lite': (32 * 10**9, 'https://cloud.google.com/tpu/docs/v6e (32 GB)'),
}
GIB = 2**30


class PlanError(ValueError):
  """A topology libtpu does not know, or a chip whose memory is not in HBM."""


def slice_of(name: str) -> dict:
  """The devices of topology `name`, their chip's memory and how many share a chip."""
  try:
    devices = topologies.get_topology_desc(platform='tpu', topology_name=name).devices
  except Exception as error:  # libtpu's kinds, or no libtpu at all
    raise PlanError(f'--topology={name}: libtpu cannot compile for it ({error}); name one such '
                    "as 'v5e:2x2' or 'v4:2x2x4', with jax[tpu] installed") from None
  kind = devices[0].device_kind
  if kind not in HBM:
    raise PlanError(f'--topology={name}: {kind} chips are not in benchmarks/tpu_plan.py\'s HBM '
                    'table; add their memory there')
  chips = len({tuple(d.coords) for d in devices})
  return {'devices': devices, 'kind': kind, 'chips': chips, 'hosts': len(
      {d.process_index for d in devices}), 'hbm': HBM[kind][0] * chips // len(devices)}


def batch_shapes(config, devices: int) -> tuple[dict, int]:
  """(train.py's batch of one micro-step as [devices, rows, max_length] shapes, rows); rows hold
  tokens_per_batch / (devices * grad_accum_steps) tokens per side."""
  tokens = config.tokens_per_batch // (devices * config.grad_accum_steps)
  rows = -(-tokens // config.max_length)
  shape = jax.ShapeDtypeStruct((devices, rows, config.max_length), np.int32)
  return {name: shape for name in batching.batch_names(config.packing)}, rows


def replicated(tree, devices: int):
  """`tree`'s shapes with a leading device axis, as pmap takes replicated arrays."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((devices, *x.shape), x.dtype), tree)


def compile_program(function, devices, donate: tuple, *args) -> dict:
  """Compiles `function` pmapped over `devices` for `args`' shapes; its per-device figures. One
  that libtpu refuses for want of memory gets its figures from libtpu's message."""
  began = time.time()
  arguments = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(args)) // len(
      devices)
  try:
    compiled = jax.pmap(function, train_step.AXIS, devices=devices,
                        donate_argnums=donate).lower(*args).compile()
  except jax.errors.JaxRuntimeError as error:
    needed = re.search(r'temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)',
                       str(error))
    if not needed:
      raise
    temporaries, available = (round(float(n) * GIB) for n in needed.groups())
    return {'compile_secs': round(time.time() - began, 1), 'flops': 0.0, 'arguments': arguments,
            'temporaries': temporaries, 'total': arguments + temporaries, 'fits': False,
            'available': available}
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes -
           memory.alias_size_in_bytes + memory.temp_size_in_bytes +
           memory.generated_code_size_in_bytes)
  return {'compile_secs': round(time.time() - began, 1), 'flops': float(cost.get('flops', 0)),
          'arguments': memory.argument_size_in_bytes, 'temporaries': memory.temp_size_in_bytes,
          'total': total}


def plan(config, topology: str) -> dict:
  """The figures of each program of `config` on `topology` (see the module's docstring)."""
  config_lib.validate(config)
  where = slice_of(topology)
  devices, count = where['devices'], len(where['devices'])
  machine = choice.Machine('tpu', where['kind'], local_devices=count // where['hosts'])
  implementations = choice.choose(config, machine)
  steps = train_step.StepFunctions(config, implementations)
  state = jax.eval_shape(lambda: packing.pack_state(train_step.initial_state(config), jnp))
  state_bytes = {part: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
                 for part, tree in (('params', state.params), ('opt_state', state.opt_state))}
  encoder, decoder = model.parameters_per_token(steps.param_shapes)
  batch, rows = batch_shapes(config, count)
  tokens = rows * config.max_length  # per device and micro-step, each side
  states = replicated(state, count)
  programs = {}
  if config.grad_accum_steps == 1:
    programs['train_step'] = compile_program(steps.train_step, devices, (0,), states, batch)
  else:
    micro = jax.ShapeDtypeStruct((count,), np.int32)
    programs['gradients'] = compile_program(steps.gradients, devices, (), states, batch, micro)
    accumulated = jax.eval_shape(jax.pmap(steps.gradients, train_step.AXIS), states, batch,
                                 micro)
    programs['accumulate'] = compile_program(steps.accumulate, devices, (3,), states, batch,
                                             micro, accumulated)
    programs['apply_gradients'] = compile_program(steps.apply_gradients, devices, (0,), states,
                                                  *accumulated)
  model_flops = 6 * (encoder + decoder) * tokens * config.grad_accum_steps
  programs['eval_step'] = compile_program(steps.eval_step, devices, (), states.params, batch)
  # A call of max_length sources, as Translator plans it.
  ((_, decode_rows, decode_length),) = decode_batches(
      [config.max_length], max(implementations.decode_batch_tokens // config.beam_size,
                               LENGTH_STEP), 1)
  model_config = config_lib.model_config(config, implementations)

  def search(params, sources):
    return decode.beam_search(model_config, params, sources, beam_size=config.beam_size,
                              alpha=config.alpha, extra_length=config.decode_extra_length)[0]

  programs['beam_search'] = compile_program(
      search, devices, (), replicated(steps.param_shapes, count),
      jax.ShapeDtypeStruct((count, decode_rows, decode_length), np.int32))
  for figures in programs.values():
    figures.setdefault('fits', figures['total'] <= where['hbm'])
  calls_per_update = {'train_step': 1, 'gradients': 1, 'accumulate': config.grad_accum_steps - 1,
                      'apply_gradients': 1}
  train_flops = sum(programs[name]['flops'] * calls for name, calls in calls_per_update.items()
                    if name in programs)
  return {'topology': topology, 'chip': where['kind'], 'chips': where['chips'],
          'devices': count, 'hosts': where['hosts'], 'hbm_per_device': where['hbm'],
          'hbm_source': HBM[where['kind']][1], 'implementations': str(implementations),
          'state_bytes': state_bytes, 'parameters': sum(
              x.size for x in jax.tree_util.tree_leaves(steps.param_shapes)),
          'train_rows': rows, 'max_length': config.max_length,
          'tokens_per_device': tokens * config.grad_accum_steps,
          'grad_accum_steps': config.grad_accum_steps, 'decode_rows': decode_rows,
          'decode_length': decode_length, 'model_flops': model_flops,
          'compiled_train_flops': train_flops, 'programs': programs}


def advice(result: dict, config) -> str | None:
  """None if every program fits; else what to change, in one line."""
  over = {name: p for name, p in result['programs'].items() if not p['fits']}
  if not over:
    return None
  name, worst = max(over.items(), key=lambda item: item[1]['total'])
  hbm = worst.get('available', result['hbm_per_device'])  # libtpu's, where it said
  fixed = worst['total'] - worst['temporaries']
  line = (f'{name} does not fit {result["topology"]}: {worst["total"] / GIB:.2f} GiB per device '
          f'against {hbm / GIB:.2f} GiB')
  if fixed >= hbm:
    return f'{line}; its arguments alone take {fixed / GIB:.2f} GiB: take chips with more memory'
  if name == 'beam_search':
    share = worst['temporaries'] / (hbm - fixed)
    tokens = int((config.decode_batch_tokens or 2**17) / share)
    return f'{line}; lower decode_batch_tokens to {tokens}'
  steps = math.ceil(config.grad_accum_steps * worst['temporaries'] / (hbm - fixed))
  return (f'{line}; raise grad_accum_steps to {steps} (or lower tokens_per_batch, or take more '
          'chips)')


def size(n: int) -> str:
  return f'{n / GIB:.2f} GiB' if n >= GIB / 10 else f'{n / 2**20:.1f} MiB'


def markdown(result: dict) -> str:
  lines = [
      f'`{result["command"]}`', '',
      f'{result["topology"]}: {result["chips"]} {result["chip"]} chips, {result["devices"]} '
      f'devices on {result["hosts"]} host(s), {size(result["hbm_per_device"])} per device '
      f'({result["hbm_source"]}); {result["implementations"]}',
      '',
      f'{result["parameters"]:,} parameters and Adam state per device: '
      f'{size(result["state_bytes"]["params"])} + {size(result["state_bytes"]["opt_state"])}. '
      f'Train batch per device: '
      f'{result["grad_accum_steps"]} x {result["train_rows"]}x{result["max_length"]} '
      f'({result["tokens_per_device"]:,} tokens a side); compiled train FLOPs '
      f'{result["compiled_train_flops"]:.3g} against the model FLOPs {result["model_flops"]:.3g} '
      f'({result["compiled_train_flops"] / max(result["model_flops"], 1):.2f}x). Beam search: '
      f'{result["decode_rows"]}x{result["decode_length"]} sources.',
      '',
      '| program | arguments | temporaries | total | of HBM | compile s | fits |',
      '| --- | --- | --- | --- | --- | --- | --- |']
  for name, p in result['programs'].items():
    lines.append(f'| {name} | {size(p["arguments"])} | {size(p["temporaries"])} | '
                 f'{size(p["total"])} | {p["total"] / result["hbm_per_device"]:.0%} | '
                 f'{p["compile_secs"]} | {"yes" if p["fits"] else "no"} |')
  return '\n'.join(lines) + '\n'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    result = plan(_CONFIG.value, _TOPOLOGY.value)
    result['command'] = ' '.join(['python -m benchmarks.tpu_plan', *sys.argv[1:]])
  except (config_lib.ConfigError, PlanError) as error:
    sys.exit(f'benchmarks.tpu_plan: {error}')
  if _NAME.value:
    write_results(_RESULTS_DIR.value, _NAME.value, result, markdown(result))
  else:
    print(markdown(result))
  if line := advice(result, _CONFIG.value):
    sys.exit(f'benchmarks.tpu_plan: {line}')


if __name__ == '__main__':
  commands.run(main, 'benchmarks.tpu_plan', config_flag=True)
