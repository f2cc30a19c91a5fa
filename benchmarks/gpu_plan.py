r"""XLA's plan for the train step on an H100, compiled on a machine without a GPU.

  pip install -e '.[cuda12]'  # jax's CUDA plugin ('.[cuda13]' too); no GPU or driver needed
  python -m benchmarks.gpu_plan [--size=base] [--shape=256x64] [--packed]
      [--variant='key=value ...']... [--flax_dir=DIR, '' for none] [--name=gpu_plan]

Compiles our train step (a plan per --variant, its `xla_flags` as the program's options, the
kernels an H100 gets from `kernels.choice`) and flax examples/wmt's for the H100 that `H100`
describes, and counts with benchmarks/hlo.py what one step launches: its kernels by class, the
bytes those that are not matmuls move, the split-K sums, the CUDA graphs and the thunks launched
alone. Without a GPU XLA cannot autotune: matmuls get its default tilings, so the plan
approximates an H100's; times come only from a GPU (benchmarks/profile_step.py). Writes
benchmarks/results/<name>.{json,md}.
"""

import glob
import os
import tempfile

# Before jax starts: its CUDA plugin checks for a driver unless told not to, and the only backend
# this runs on is the CPU.
os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from benchmarks.hlo import kernel_bytes, kernels_by_class, launches, split_k_sums  # noqa: E402
from benchmarks.measure import write_results  # noqa: E402
from benchmarks.workload import (Flax, Ours, define_workload_flags,  # noqa: E402
                                 fetch_flax_examples, load_config, parse_shape)
from transformer.data import batching  # noqa: E402
from transformer.kernels.choice import Machine  # noqa: E402

# An H100 80GB HBM3 (SXM) as XLA's GpuTargetConfig describes a device; CUDA 12.9 and cuDNN 9.8,
# as jax[cuda12] installs them, and the H100 machine's driver (580, CUDA 13.0): without a driver
# version XLA leaves cuBLAS's calls out of its CUDA graphs, which on the H100 hold them.
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536 driver_version: "13.0.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
H100_MACHINE = Machine('gpu', 'NVIDIA H100 80GB HBM3', '9.0', 1)


def h100_mesh():
  """A one-device mesh of an H100 described by `H100`, its axis 'batch' (the pmapped axis of the
  steps). Exits with what to install where jax cannot compile for a GPU."""
  try:
    topology = topologies.get_topology_desc(platform='cuda', target_config=H100,
                                            topology='1x1x1')
  except Exception as error:  # jax raises NotImplementedError or RuntimeError
    raise SystemExit(f"benchmarks.gpu_plan: jax cannot compile for a GPU here ({error}); "
                     "install its CUDA plugin: pip install -e '.[cuda12]' or '.[cuda13]'") from None
  return topologies.make_mesh(topology, (1,), ('batch',))


def plan(hlo: str, thunks: str) -> dict:
  """The kernels by class, the bytes of those that are not matmuls, the split-K sums and the
  host's launches of an optimized GPU module and its thunk sequence."""
  sums = split_k_sums(hlo)
  return {'kernels': kernels_by_class(hlo), 'kernel_bytes': kernel_bytes(hlo),
          'split_k_sums': len(sums), 'transposed_sums': sum(s['transposed'] for s in sums),
          'launches': launches(thunks)}


def compile_for_h100(mesh, step, args, options: dict) -> tuple[str, str]:
  """The optimized HLO and the thunk sequence of the per-device `step` (pmapped in training, its
  axis 'batch') compiled for `h100_mesh()`: under shard_map over it, so that its collectives
  have their axis."""
  replicated = NamedSharding(mesh, PartitionSpec())
  args = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), args)
  mapped = jax.shard_map(step, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                         check_vma=False)
  with tempfile.TemporaryDirectory() as dump:  # the thunks are only in XLA's dump
    lowered = jax.jit(mapped).lower(*args)
    compiled = lowered.compile(compiler_options={**options, 'xla_dump_to': dump})
    # The sequence after XLA's passes over it (which form the CUDA graphs), where they changed it.
    paths = (glob.glob(os.path.join(dump, '*.thunk_sequence_after_thunk_passes.txt')) or
             glob.glob(os.path.join(dump, '*.thunk_sequence.txt')))
    with open(paths[0]) as f:
      return compiled.as_text(), f.read()


def markdown(results: dict) -> str:
  rows = results['rows']
  classes = sorted({c for row in rows for c in row['kernels']})
  lines = [f'XLA\'s plan of one train step for an NVIDIA H100, compiled without one by jax '
           f'{results["jax"]} (`python -m benchmarks.gpu_plan`): {results["size"]} size, '
           f'{results["shape"]} batch. '
           'GB moved: what the kernels that are not matmuls or cuDNN\'s attention read and '
           'write, Pallas kernels (class other) included (`benchmarks.hlo.kernel_bytes`), which '
           'bounds their time from below at the H100\'s '
           '3.35 TB/s. Split-K sums: the kernels adding split-K matmuls\' partial '
           'products; transposed: those that write them in another layout than the matmul. '
           'CUDA graphs: the command buffers the host launches the kernels in, each at once; '
           'launched alone: the kernels, library calls, copies and loops it launches one by '
           'one outside them (`benchmarks.hlo.launches`).', '',
           '| side | variant | kernels | ' + ' | '.join(classes) +
           ' | GB moved | split-K sums | transposed | CUDA graphs | launched alone |',
           '| --- | --- | --- | ' + ' | '.join('---' for _ in classes) +
           ' | --- | --- | --- | --- | --- |']
  for row in rows:
    lines.append(f"| {row['side']} | {row['variant'] or 'as configured'} | "
                 f"{sum(row['kernels'].values())} | " +
                 ' | '.join(str(row['kernels'].get(c, 0)) for c in classes) +
                 f" | {sum(row['kernel_bytes'].values()) / 1e9:.2f} | {row['split_k_sums']} | "
                 f"{row['transposed_sums']} | {row['launches']['cuda_graphs']} | "
                 f"{row['launches']['alone']} |")
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  jax.config.update('jax_enable_compilation_cache', False)  # a cached program leaves no dump
  mesh = h100_mesh()
  jax.default_backend = lambda: 'gpu'  # the Pallas kernels lower for a GPU, not the interpreter
  rows, length = parse_shape(_SHAPE.value)
  batch = {name: jax.ShapeDtypeStruct((rows, length), jnp.int32)
           for name in batching.batch_names(_PACKED.value)}
  plans = []
  for variant in _VARIANTS.value or ['']:
    ours = Ours(load_config(variant, _SIZE.value), H100_MACHINE)
    state = jax.tree_util.tree_map(lambda x: x[0], ours.state)
    compiled = compile_for_h100(mesh, ours.steps.train_step, (state, batch),
                                ours.compiler_options)
    plans.append({'side': 'ours', 'variant': variant, **plan(*compiled)})
  if _FLAX_DIR.value:
    theirs = Flax(fetch_flax_examples(_FLAX_DIR.value), ours)
    state = jax.tree_util.tree_map(lambda x: x[0], theirs.state)
    step = lambda state, batch, rng: theirs.train_step(state, batch, dropout_rng=rng)
    compiled = compile_for_h100(mesh, step, (state, theirs.inputs(batch),
                                             theirs.dropout_rngs[0]), {})
    plans.append({'side': 'flax', 'variant': '', **plan(*compiled)})
  results = {'size': _SIZE.value, 'shape': _SHAPE.value + (' packed' if _PACKED.value else ''),
             'device': 'NVIDIA H100 80GB HBM3', 'jax': jax.__version__, 'rows': plans}
  write_results(_OUTPUT.value, _NAME.value, results, markdown(results))


if __name__ == '__main__':  # flags here: the tests import the module beside other benchmarks
  _SIZE, _VARIANTS, _FLAX_DIR, _NAME, _OUTPUT, _SHAPE, _PACKED = define_workload_flags(
      'gpu_plan', 'one plan each, the config as it is without one', size='base', shape='256x64')
  app.run(main)
