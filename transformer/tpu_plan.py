"""Whether a config's programs compile for a Cloud TPU slice and fit its chips' memory, checked on
a machine without a TPU, before renting one: the library of the tpu_plan.py command, which says
how (libtpu's compile-only client; JAX_PLATFORMS=cpu and ALLOW_MULTIPLE_LIBTPU_LOAD=1 set before
jax is imported).
"""

import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from transformer import config as config_lib
from transformer import metrics, train_step
from transformer.data import batching, token_store
from transformer.kernels import choice, packing
from transformer.translate import decode_batches, search_function, source_tokens_per_device

# A chip's memory as Google gives it, for the reader: device kind -> (bytes, where, as written
# there). What a program may take is libtpu's figure (`available_hbm`), that of a GiB-sized HBM.
HBM = {
    'TPU v4': (32 * 2**30, 'https://cloud.google.com/tpu/docs/v4 (32 GiB)'),
    'TPU v5 lite': (16 * 10**9, 'https://cloud.google.com/tpu/docs/v5e (16 GB)'),
    'TPU v5': (95 * 10**9, 'https://cloud.google.com/tpu/docs/v5p (95 GB)'),
    'TPU v6 lite': (32 * 10**9, 'https://cloud.google.com/tpu/docs/v6e (32 GB)'),
}
GIB = 2**30
SAMPLE_PAIRS = 200_000  # pairs whose lengths give the batch shapes; their means settle sooner
STAND_IN = 'WMT-like lengths (stand_in_lengths)'
PROGRAMS = ('train', 'eval', 'beam_search')  # the kinds of program a plan may compile
# libtpu's line for a program over a device's memory; its "temporaries" count the arguments too.
_OVER = re.compile(r'temporaries \(([\d.]+[KMGT])\) exceeds available HBM \(([\d.]+[KMGT])\)')


def _bytes(figure: str) -> int:
  """libtpu's '15.75G' in bytes."""
  return round(float(figure[:-1]) * 2**(10 * ' KMGT'.index(figure[-1])))


class PlanError(ValueError):
  """A topology libtpu does not know."""


def slice_of(name: str) -> dict:
  """The devices of topology `name` as JAX sees them on a Cloud TPU VM slice of that shape: one
  device per chip (v4 and v5p run their chip's two cores as one, "megacore"), and hosts of 8
  chips for v5e and v6e slices of up to 8 chips, of 4 chips otherwise; the memory a program may
  take on each device."""
  generation, _, shape = name.partition(':')
  options = {}
  if generation in ('v4', 'v5', 'v5p'):
    options['chip_config_name'] = 'megacore'
  sides = [int(side) for side in shape.split('x') if side.isdigit()]
  if generation in ('v5e', 'v6e') and sides and math.prod(sides) <= 8:
    options['chips_per_host_bounds'] = (*sides, 1, 1)[:3]
  try:
    devices = topologies.get_topology_desc(platform='tpu', topology_name=name, **options).devices
  except Exception as error:  # libtpu's kinds, or no libtpu at all
    raise PlanError(f'--topology={name}: libtpu cannot compile for it ({error}); name one such '
                    "as 'v5e:2x2' or 'v4:2x2x4', with jax[tpu] installed") from None
  kind = devices[0].device_kind
  return {'devices': devices, 'kind': kind, 'chips': len({tuple(d.coords) for d in devices}),
          'hosts': len({d.process_index for d in devices}), 'hbm': available_hbm(devices),
          'hbm_chip': HBM.get(kind, (None, 'not in tpu_plan.HBM'))}


def available_hbm(devices) -> int:
  """The bytes a program may take on each of `devices`, as libtpu says when refusing one that
  takes more than any chip has."""
  def too_big(x):  # a sort's operand, 2**10 x 2**27 float32, is a temporary no fusion removes
    return jnp.sort(x[:, None] + jnp.arange(2**27, dtype=x.dtype), axis=1)[:, -1]

  try:
    jax.pmap(too_big, devices=devices).lower(
        jax.ShapeDtypeStruct((len(devices), 2**10), np.float32)).compile()
  except jax.errors.JaxRuntimeError as error:
    if over := _OVER.search(str(error)):
      return _bytes(over[2])
    raise
  raise PlanError(f'libtpu compiled a program of {2**39 / GIB:.0f} GiB for '
                  f'{devices[0].device_kind}: its available memory is unknown')


def stand_in_lengths(pairs: int = SAMPLE_PAIRS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """WMT-like (source, target) lengths in tokens, EOS included: sentence lengths lognormal with
  sigma 0.6, as benchmarks.wmt_scale generates its WMT14-sized corpus, at the median (25 tokens)
  that gives its 31 tokens a side on average; the target the source's length x lognormal(0,
  0.2)."""
  rng = np.random.default_rng(seed)
  source = np.maximum(1, np.rint(rng.lognormal(np.log(25), 0.6, pairs)))
  target = np.maximum(1, np.rint(source * rng.lognormal(0, 0.2, pairs)))
  return source.astype(np.int64) + 1, target.astype(np.int64) + 1


def stored_lengths(directory: str) -> tuple[np.ndarray, np.ndarray]:
  """The (source, target) lengths of a split's token store (the directory prepare.py names for
  it), a random SAMPLE_PAIRS of them at most."""
  try:
    source, target = (token_store.load_array(os.path.join(directory, f'{side}_lengths.npy'))
                      for side in token_store.SIDES)
  except (OSError, ValueError) as error:
    raise PlanError(f'--lengths_from={directory}: not a token store ({error}); give the '
                    'directory prepare.py names for the train split') from None
  if len(source) != len(target):
    raise PlanError(f'--lengths_from={directory}: {len(source)} source and {len(target)} '
                    'target lengths; prepare the split again')
  sample = np.sort(np.random.default_rng(0).permutation(len(source))[:SAMPLE_PAIRS])
  return np.asarray(source[sample]), np.asarray(target[sample])


def batch_shapes(config, devices: int, lengths) -> dict:
  """The [rows, length] of the train batches whose memory bounds that of every batch train.py
  builds from pairs of `lengths`, and of the evaluation batch; rows hold the real tokens of a
  device's micro-batch (tokens_per_batch / (devices * grad_accum_steps) a side) and padding.

  Packed, every batch is max_length rows, as many as hold the budget at the mean fill of packed
  rows. In length buckets, the two that take the most: the longest bucket at as many rows as it
  can have (each row there holds more tokens than the next shorter bucket's length, whatever the
  data), and the bucket with the most [rows x length] slots, at the budget over the mean real
  tokens of its rows. Evaluation batches are packed (`batching.eval_batches`).
  """
  tokens = config.tokens_per_batch // (devices * config.grad_accum_steps)
  empty = [token_store.Ragged(np.zeros(int(side.sum()), np.uint8), side) for side in lengths]
  tokenized = token_store.Tokenized('lengths', *empty)
  buckets = batching.bucket_lengths(config.max_length)

  def budget_rows(pack_rows: bool) -> list[int]:  # per bucket length, as train.py's plan has them
    shards = batching.split_shards(tokenized, config, range(1), 1, pack_rows)
    return batching.budget_rows(batching.shard_table(shards), tokens)

  packed = (budget_rows(True)[-1], config.max_length)
  if config.packing or len(buckets) == 1:
    train = [packed]
  else:
    rows = budget_rows(False)
    most_slots = max(zip(rows, buckets), key=lambda shape: shape[0] * shape[1])
    train = list(dict.fromkeys([(-(-tokens // (buckets[-2] + 1)), buckets[-1]), most_slots]))
  return {'tokens': tokens, 'train': train, 'eval': packed}


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
    if not (over := _OVER.search(str(error))):
      raise
    total = _bytes(over[1])
    return {'compile_secs': round(time.time() - began, 1), 'flops': 0.0, 'arguments': arguments,
            'temporaries': total - arguments, 'total': total, 'fits': False}
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes -
           memory.alias_size_in_bytes + memory.temp_size_in_bytes +
           memory.generated_code_size_in_bytes)
  return {'compile_secs': round(time.time() - began, 1), 'flops': float(cost.get('flops', 0)),
          'arguments': memory.argument_size_in_bytes, 'temporaries': memory.temp_size_in_bytes,
          'total': total, 'fits': True,  # libtpu refuses what does not fit
          # Calls out of XLA's own operations (a Pallas kernel is a 'tpu_custom_call').
          'custom_calls': sorted(set(re.findall(r'custom_call_target="([^"]+)"',
                                                compiled.as_text())))}


def plan(config, topology: str, lengths=None, lengths_source: str = '',
         kinds=PROGRAMS) -> dict:
  """The figures of each program of `config` on `topology` (see the module's docstring), its
  batches shaped for pairs of `lengths` ((source, target) tokens; `stand_in_lengths` if None);
  only the programs of `kinds` (of PROGRAMS)."""
  config_lib.validate(config)
  if unknown := set(kinds) - set(PROGRAMS):
    raise PlanError(f'--programs: {", ".join(sorted(unknown))} unknown; name some of '
                    f'{",".join(PROGRAMS)}')
  where = slice_of(topology)
  devices, count = where['devices'], len(where['devices'])
  machine = choice.Machine('tpu', where['kind'], local_devices=count // where['hosts'])
  implementations = choice.choose(config, machine)
  steps = train_step.StepFunctions(config, implementations)
  state = jax.eval_shape(lambda: packing.pack_state(train_step.initial_state(config), jnp))
  state_bytes = {part: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
                 for part, tree in (('params', state.params), ('opt_state', state.opt_state))}
  parameters = metrics.parameters_per_token(steps.param_shapes)
  shapes = batch_shapes(config, count, stand_in_lengths() if lengths is None else lengths)
  states = replicated(state, count)

  def batch(rows: int, length: int, packed: bool) -> dict:
    shape = jax.ShapeDtypeStruct((count, rows, length), np.int32)
    return {name: shape for name in batching.batch_names(packed)}

  programs, longest = {}, shapes['train'][0]
  for rows, length in shapes['train'] if 'train' in kinds else ():
    name, train_batch = f'{rows}x{length}', batch(rows, length, config.packing)
    if config.grad_accum_steps == 1:
      programs[f'train_step {name}'] = compile_program(steps.train_step, devices, (0,), states,
                                                       train_batch)
      continue
    micro = jax.ShapeDtypeStruct((count,), np.int32)
    programs[f'gradients {name}'] = compile_program(steps.gradients, devices, (), states,
                                                    train_batch, micro)
    # vmap, not pmap: the shapes on `count` devices, whatever this machine has.
    accumulated = jax.eval_shape(jax.vmap(steps.gradients, axis_name=train_step.AXIS), states,
                                 train_batch, micro)
    programs[f'accumulate {name}'] = compile_program(steps.accumulate, devices, (3,), states,
                                                     train_batch, micro, accumulated)
  if 'train' in kinds and config.grad_accum_steps > 1:  # the same program whatever the batch
    programs['apply_gradients'] = compile_program(steps.apply_gradients, devices, (0,), states,
                                                  *accumulated)
  if 'eval' in kinds:
    rows, length = shapes['eval']
    programs[f'eval_step {rows}x{length}'] = compile_program(
        steps.eval_step, devices, (), states.params, batch(rows, length, packed=True))
  if 'beam_search' in kinds:  # a call of max_length sources, as Translator plans it
    ((_, decode_rows, decode_length),) = decode_batches(
        [config.max_length], source_tokens_per_device(implementations, config.beam_size), 1)
    search = search_function([config], implementations, config.beam_size, config.alpha)
    programs[f'beam_search {decode_rows}x{decode_length}'] = compile_program(
        search, devices, (), replicated(steps.param_shapes, count),
        jax.ShapeDtypeStruct((count, decode_rows, decode_length), np.int32),
        jax.ShapeDtypeStruct((count, decode_rows), np.int32))
  # Per update, at the longest batch: its padding's FLOPs and attention's over max_length count.
  shape = f'{longest[0]}x{longest[1]}'
  calls_per_update = {f'train_step {shape}': 1, f'gradients {shape}': 1,
                      f'accumulate {shape}': config.grad_accum_steps - 1, 'apply_gradients': 1}
  train_flops = sum(programs[name]['flops'] * calls for name, calls in calls_per_update.items()
                    if name in programs)
  return {'topology': topology, 'chip': where['kind'], 'chips': where['chips'],
          'devices': count, 'hosts': where['hosts'], 'hbm_per_device': where['hbm'],
          'hbm_chip': where['hbm_chip'][0], 'hbm_source': where['hbm_chip'][1],
          'implementations': str(implementations),
          'state_bytes': state_bytes, 'parameters': sum(
              x.size for x in jax.tree_util.tree_leaves(steps.param_shapes)),
          'lengths': lengths_source or STAND_IN,
          'train_shapes': shapes['train'], 'tokens_per_device': shapes['tokens'],
          'grad_accum_steps': config.grad_accum_steps,
          'model_flops': metrics.model_flops(parameters, shapes['tokens'], shapes['tokens']) *
                         config.grad_accum_steps,
          'compiled_train_flops': train_flops, 'programs': programs}


def advice(result: dict, config) -> str | None:
  """None if every program fits; else what to change, in one line."""
  over = {name: p for name, p in result['programs'].items() if not p['fits']}
  if not over:
    return None
  name, worst = max(over.items(), key=lambda item: item[1]['total'])
  hbm = result['hbm_per_device']
  fixed = worst['total'] - worst['temporaries']
  line = (f'{name} does not fit {cloud_name(result)} ({result["topology"]}): '
          f'{worst["total"] / GIB:.2f} GiB per device '
          f'against {hbm / GIB:.2f} GiB')
  if fixed >= hbm:
    return f'{line}; its arguments alone take {fixed / GIB:.2f} GiB: take chips with more memory'
  if name.startswith('beam_search'):
    share = worst['temporaries'] / (hbm - fixed)
    tokens = int((config.implementation.decode_batch_tokens or 2**17) / share)
    return f'{line}; lower implementation.decode_batch_tokens to {tokens}'
  steps = math.ceil(config.grad_accum_steps * worst['temporaries'] / (hbm - fixed))
  return (f'{line}; raise grad_accum_steps to {steps} (or lower tokens_per_batch, or take more '
          'chips)')


def cloud_name(plan: dict) -> str:
  """The slice as Cloud TPU names it: v4 and v5p by TensorCores (2 a chip), v5e and v6e by chips."""
  generation = plan['topology'].split(':')[0]
  generation = {'v5': 'v5p'}.get(generation, generation)
  return f'{generation}-{(2 if generation in ("v4", "v5p") else 1) * plan["chips"]}'


def size(n: int) -> str:
  """`n` bytes, readably."""
  return f'{n / GIB:.2f} GiB' if n >= GIB / 10 else f'{n / 2**20:.1f} MiB'


def shares(result: dict) -> list[str]:
  """Each compiled train shape, and the share of its slots that the real tokens fill."""
  return [f'{rows}x{length}: {result["tokens_per_device"] / (rows * length):.0%} real'
          for rows, length in result['train_shapes']]


def details(result: dict) -> str:
  """One plan in markdown: the slice, the state and batch, a row per program."""
  lines = [
      f'`{result["command"]}`', '',
      f'{cloud_name(result)} ({result["topology"]}): {result["chips"]} {result["chip"]} chips, '
      f'{result["devices"]} '
      f'devices on {result["hosts"]} host(s); a program may take '
      f'{size(result["hbm_per_device"])} of each device (libtpu; a chip\'s memory: '
      f'{result["hbm_source"]}); {result["implementations"]}',
      '',
      f'{result["parameters"]:,} parameters and Adam state per device: '
      f'{size(result["state_bytes"]["params"])} + {size(result["state_bytes"]["opt_state"])}. '
      f'Train batches per device: {result["grad_accum_steps"]} x '
      f'{result["tokens_per_device"]:,} real tokens a side and their padding, for '
      f'{result["lengths"]}; compiled at the shapes that take the most '
      f'({", ".join(shares(result))}). Compiled train FLOPs {result["compiled_train_flops"]:.3g} '
      f'against the model FLOPs of the real tokens {result["model_flops"]:.3g} '
      f'({result["compiled_train_flops"] / max(result["model_flops"], 1):.2f}x).',
      '',
      '| program | arguments | temporaries | total | of HBM | compile s | fits |',
      '| --- | --- | --- | --- | --- | --- | --- |']
  for name, p in result['programs'].items():
    lines.append(f'| {name} | {size(p["arguments"])} | {size(p["temporaries"])} | '
                 f'{size(p["total"])} | {p["total"] / result["hbm_per_device"]:.0%} | '
                 f'{p["compile_secs"]} | {"yes" if p["fits"] else "no"} |')
  return '\n'.join(lines) + '\n'


def markdown(rows: dict) -> str:
  """Every plan in `rows` (label -> plan): a line each, then each one's details."""
  def cell(plan, kinds):
    programs = [p for name, p in plan['programs'].items() if name.split()[0] in kinds]
    if not programs:
      return 'not compiled'
    total = max(p['total'] for p in programs)
    fits = all(p['fits'] for p in programs)
    return f'{size(total)} ({total / plan["hbm_per_device"]:.0%}){"" if fits else ", no"}'

  lines = ['Per device, against what libtpu lets a program take there:', '',
           '| arguments | slice | chips, hosts | train step | eval step | beam search |',
           '| --- | --- | --- | --- | --- | --- |']
  for label, plan in rows.items():
    lines.append(f'| `{label}` | {cloud_name(plan)} | {plan["chips"]}, {plan["hosts"]} | '
                 f'{cell(plan, ("train_step", "gradients", "accumulate", "apply_gradients"))} | '
                 f'{cell(plan, ("eval_step",))} | {cell(plan, ("beam_search",))} |')
  return '\n'.join(lines + [''] + [details(plan) for plan in rows.values()])
