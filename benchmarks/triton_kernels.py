r"""The registers and shared memory an H100 would give each Pallas (Triton) kernel of a program,
and so how many of its warps an SM holds at once, read without a GPU.

  pip install -e '.[cuda13]' triton  # jax's CUDA plugin; Triton's compiler, ptxas inside

XLA compiles Pallas's kernels with its own copy of Triton, and its deviceless compilation
(benchmarks/gpu_plan.py) writes no PTX, so a kernel that spills registers, or one that leaves an
SM too few warps to hide memory's latency with, would show only on a GPU. Each kernel's Triton
module is in the lowered program, in its custom call's backend config; the `triton` package
compiles it for sm_90 and cuobjdump reads the registers and stack (spilled registers) of the
binary. Triton's version is not XLA's, so the figures are a close guide, not XLA's own.
"""

import functools
import os
import re
import subprocess
import tempfile

# An H100's streaming multiprocessor (CUDA's occupancy rules for compute capability 9.0).
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are given to a warp in units of 256
WARPS_PER_SM = 64
PROGRAMS_PER_SM = 32
SHARED_PER_SM = 233472
SHARED_RESERVED = 1024  # CUDA keeps 1 KiB of each program's shared memory


def modules(stablehlo) -> list[dict]:
  """The distinct Triton kernels of a lowered program (`jax.jit(f).lower(...).compiler_ir()`):
  each one's name, warps, pipeline stages and Triton module as text, in the program's order."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir

  found = {}

  def visit(operation):
    for region in operation.regions:
      for block in region:
        for child in block:
          if (child.name == 'stablehlo.custom_call' and
              ir.StringAttr(child.attributes['call_target_name']).value ==
              '__gpu$xla.gpu.triton'):
            config = ir.DictAttr(child.attributes['mhlo.backend_config'])
            found.setdefault((ir.StringAttr(config['ir']).value_bytes,
                              ir.IntegerAttr(config['num_warps']).value,
                              ir.IntegerAttr(config['num_stages']).value),
                             ir.StringAttr(config['name']).value)
          visit(child)

  visit(stablehlo.operation)
  if not found:
    return []
  # jax keeps the Triton dialect, needed to print the modules' bytecode, in a private module.
  from jax._src.lib.triton import dialect as triton_dialect

  context = mlir.make_ir_context()
  triton_dialect.register_dialect(context)
  kernels = []
  for (bytecode, warps, stages), name in found.items():
    with context:
      text = ir.Module.parse(bytecode).operation.get_asm()
    kernels.append({'name': name, 'warps': warps, 'stages': stages, 'module': text})
  return kernels


def resident_warps(registers: int, warps: int, shared: int) -> int:
  """Warps of a kernel's programs that an SM holds at once: as many programs as its registers,
  shared memory, warps and program slots allow."""
  per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
  programs = min((REGISTERS_PER_SM // per_warp) // warps,
                 SHARED_PER_SM // (shared + SHARED_RESERVED), WARPS_PER_SM // warps,
                 PROGRAMS_PER_SM)
  return programs * warps


@functools.cache
def _compile(module: str, warps: int, stages: int) -> dict:
  import triton
  from triton.backends.compiler import GPUTarget

  with tempfile.TemporaryDirectory() as folder:
    source = os.path.join(folder, 'kernel.ttir')  # Triton reads a module from a .ttir file
    with open(source, 'w') as f:
      f.write(module)
    compiled = triton.compile(source, target=GPUTarget('cuda', 90, 32),
                              options={'num_warps': warps, 'num_stages': stages,
                                       'enable_fp_fusion': True})  # as XLA: fused multiply-adds
    binary = os.path.join(folder, 'kernel.cubin')
    with open(binary, 'wb') as f:
      f.write(compiled.asm['cubin'])
    usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, '--dump-resource-usage', binary],
                           capture_output=True, text=True, check=True).stdout
  registers, stack = (int(re.search(rf'\b{field}:(\d+)', usage).group(1))
                      for field in ('REG', 'STACK'))
  return {'registers': registers, 'stack_bytes': stack, 'shared_bytes': compiled.metadata.shared,
          'warps_per_sm': resident_warps(registers, warps, compiled.metadata.shared)}


def resources(kernels: list[dict]) -> list[dict] | str:
  """Each kernel of `modules` with its registers a thread, stack bytes a thread (registers spilled
  to memory, 0 when none), shared memory bytes a program, and warps an SM holds at once (or the
  error Triton raised); or why there are none (Triton not installed)."""
  if not kernels:
    return []
  try:
    import triton
  except ImportError:
    return 'not read: pip install triton'
  rows = []
  for kernel in kernels:
    try:
      figures = _compile(kernel['module'], kernel['warps'], kernel['stages'])
    except Exception as error:  # Triton's parser or compiler, of another version than XLA's
      figures = {'error': f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'}
    rows.append({'name': kernel['name'], 'warps': kernel['warps'], 'triton': triton.__version__,
                 **figures})
  return rows


def table(rows: list[dict]) -> list[str]:
  """Markdown lines of the Triton kernels (`resources`) of plan rows (`benchmarks.gpu_plan`, with
  'side', 'variant' and 'triton_kernels'), those alike on one line (a kernel for each shape it
  takes), or why there are none; no lines where no row has a kernel."""
  unread = {row['triton_kernels'] for row in rows if isinstance(row['triton_kernels'], str)}
  if unread:
    return ['', f"Triton kernels' registers: {', '.join(sorted(unread))}."]
  lines = {}
  for row in rows:
    for kernel in row['triton_kernels']:
      figures = (f"{kernel['registers']} | {kernel['stack_bytes']} | "
                 f"{kernel['shared_bytes'] / 1024:.1f} | {kernel['warps_per_sm']}"
                 if 'error' not in kernel else f"{kernel['error']} | | |")
      line = (f"| {row['side']} | {row['variant'] or 'as configured'} | {kernel['name']} | "
              f"{kernel['warps']} | {figures} |")
      lines[line] = lines.get(line, 0) + 1
  if not lines:
    return []
  version = next(kernel['triton'] for row in rows for kernel in row['triton_kernels'])
  return ['', f'The Pallas kernels as Triton {version} compiles them for sm_90 '
          '(`benchmarks.triton_kernels`): registers and stack bytes (registers spilled to '
          'memory) a thread, shared memory a program, and the warps an SM holds at once (of 64); '
          'shapes: the kernel\'s shapes with these figures.', '',
          '| side | variant | kernel | warps | registers | stack bytes | shared KiB | '
          'warps per SM | shapes |',
          '| --- | --- | --- | --- | --- | --- | --- | --- | --- |',
          *(f'{line} {count} |' for line, count in lines.items())]
