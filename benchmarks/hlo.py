"""Reading XLA's optimized HLO text: what each instruction computes, which kernels a step
launches, how many bytes the kernels that are not matmuls move, and how split-K matmuls' partial
products are summed; and XLA's thunk sequence: what the host launches, in CUDA graphs or alone."""

import collections
import math
import re

_COMPUTATION = re.compile(r'^%?(\S+) .*\{$')
# name, shape, opcode, operands
_OPERATION = re.compile(r'^\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(([^)]*)\)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r'calls=%?([\w.\-]+)')  # the computation a fusion or call runs
_GEMM = re.compile(r'custom_call_target="[^"]*(gemm|matmul)')  # cuBLAS's matmuls
_PALLAS_KERNEL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"')  # Pallas on Triton


def _operations(hlo: str) -> dict[str, list[tuple[str, str, str, list[str], str]]]:
  """{computation: [(name, shape, opcode, operand names, line)]} of an HLO module's text; the
  entry computation is 'ENTRY'."""
  bodies, current = {}, None
  for line in hlo.splitlines():
    if not line.startswith(' ') and (match := _COMPUTATION.match(line)):
      current = bodies.setdefault(match.group(1), [])
    elif current is not None and (match := _OPERATION.match(line)):
      name, shape, opcode, operands = match.groups()
      current.append((name, shape, opcode, re.findall(r'%([\w.\-]+)', operands), line))
  return bodies


def hlo_classes(hlo: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (class, jax op name)} for the instructions of an optimized HLO module."""
  bodies = _operations(hlo)

  def lines(computation: str, seen=()) -> list[tuple[str, str]]:
    """(opcode, line) of a computation's instructions and of those of the computations it calls."""
    found = []
    for _, _, opcode, _, line in bodies.get(computation, ()):
      found.append((opcode, line))
      for callee in re.findall(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)', line):
        if callee not in seen:
          found += lines(callee, (*seen, computation))
    return found

  classes = {}
  for instructions in bodies.values():
    for name, _, opcode, _, line in instructions:
      called = _CALLS.findall(line)
      body = [pair for c in called for pair in lines(c)] or [(opcode, line)]
      inside = {op for op, _ in body}
      computed = inside - {'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast'}
      # A matmul is named by its dot or cuBLAS's call, which a fusion may wrap to read its
      # operands' slices in place (XLA's dynamic-slice fusion).
      dots = [text for op, text in body
              if op in ('dot', 'convolution') or op == 'custom-call' and _GEMM.search(text)]
      op_name = _OP_NAME.search(dots[0] if dots else line)
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


_SUM_OF_PARTS = re.compile(r'= f32\[\d+,\d+\]\{(\d,\d)\} reduce\([^\n]*dimensions=\{0\}')


def kernels_by_class(hlo: str) -> dict[str, int]:
  """The kernels one call of an optimized GPU HLO module launches (its entry computation's
  fusions and library calls), counted by their `hlo_classes`."""
  classes = hlo_classes(hlo)
  counts = collections.Counter(classes.get(name, ('other',))[0]
                               for name, _, opcode, _, _ in _operations(hlo).get('ENTRY', [])
                               if opcode in ('fusion', 'custom-call'))
  return dict(sorted(counts.items()))


_BYTES_PER_ELEMENT = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2,
                      'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}
_ARRAY = re.compile(r'\b([a-z]+\d*)\[([\d,]*)\]')


def shape_bytes(shape: str) -> int:
  """The bytes of an HLO shape, a tuple's arrays summed: 'bf16[16,64]{1,0}' is 2048."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    total += _BYTES_PER_ELEMENT.get(dtype, 0) * math.prod(int(d) for d in dims.split(',') if d)
  return total


def _fused(bodies, opcode: str, line: str) -> list | None:
  """The operations of the computation an entry operation fuses, or None if it is no fusion."""
  called = _CALLS.search(line)
  return bodies.get(called.group(1), []) if opcode == 'fusion' and called else None


def _elements(shape: str) -> int:
  """The elements of an array's HLO shape: 'bf16[16,64]{1,0}' has 1024."""
  (_, dims), = _ARRAY.findall(shape)
  return math.prod(int(d) for d in dims.split(',') if d)


def _bytes_read(body, index: int, whole: int) -> int:
  """What a fused computation reads of its parameter `index`: the slices it takes, where it
  only slices it (through bitcasts, and converts, which read element by element), else all of
  it."""
  names, elements, sliced = set(), 1, 0
  for name, shape, opcode, _, line in body:
    if opcode == 'parameter' and f'parameter({index})' in line:
      names.add(name)
      elements = _elements(shape)
  for name, shape, opcode, operands, _ in body:  # operations come after their operands
    if names & set(operands):
      if opcode in ('bitcast', 'convert'):
        names.add(name)
      elif opcode == 'slice':
        sliced += _elements(shape)
      else:
        return whole
  return sliced * whole // elements or whole


def kernel_bytes(hlo: str) -> dict[str, int]:
  """The bytes that one call of an optimized GPU module's fusion kernels which are not matmuls,
  and its Pallas kernels ('other'), read and write, by `hlo_classes` class: each output whole,
  each operand whole (once, where a Pallas kernel takes it more than once) or, where a fusion
  only slices it, the slices.

  Such kernels are bound by memory bandwidth, so these bytes over the device's bandwidth bound
  their time from below.
  """
  bodies = _operations(hlo)
  shapes = {name: shape for body in bodies.values() for name, shape, *_ in body}
  classes = hlo_classes(hlo)
  moved = collections.Counter()
  for name, shape, opcode, operands, line in bodies.get('ENTRY', []):
    if _PALLAS_KERNEL.search(line):  # a Pallas kernel of ours: its operands and outputs whole,
      # an operand passed more than once (slots of one array) once
      moved['other'] += shape_bytes(shape) + sum(shape_bytes(shapes.get(operand, ''))
                                                 for operand in dict.fromkeys(operands))
      continue
    body = _fused(bodies, opcode, line)
    if body is None or classes.get(name, ('other',))[0] == 'matmul':
      continue
    moved[classes[name][0]] += shape_bytes(shape) + sum(
        _bytes_read(body, index, shape_bytes(shapes.get(operand, '')))
        for index, operand in enumerate(operands))
  return dict(sorted(moved.items()))


def split_k_sums(hlo: str) -> list[dict]:
  """The sums of split-K matmuls' partial products, f32[parts, m, n], in an optimized GPU HLO
  module: per sum, the parts and whether it writes them transposed ({0,1} where the matmul
  wrote {2,1,0}), a sum that reads across rows."""
  bodies = _operations(hlo)
  entry = bodies.get('ENTRY', [])
  opcodes = {name: opcode for name, _, opcode, _, _ in entry}
  matmuls = {}  # partial products: a Triton fusion's output, or a cuBLAS call's first
  for name, shape, opcode, operands, line in entry:
    parts = re.match(r'f32\[(\d+),\d+,\d+\]\{2,1,0\}$', shape)
    if parts and (opcode == 'fusion' and 'kind=kCustom' in line or
                  opcode == 'get-tuple-element' and opcodes.get(operands[0]) == 'custom-call'):
      matmuls[name] = int(parts.group(1))
  sums = []
  for name, _, opcode, operands, line in entry:
    body = _fused(bodies, opcode, line)
    parts = [matmuls[operand] for operand in operands if operand in matmuls]
    if body is None or not parts:
      continue
    for *_, body_line in body:
      if reduction := _SUM_OF_PARTS.search(body_line):
        sums.append({'parts': parts[0], 'transposed': reduction.group(1) == '0,1'})
        break
  return sums


_THUNK = re.compile(r'^\d+: (k\w+)', re.MULTILINE)  # a top-level thunk; nested ones are indented


def launches(thunk_sequence: str) -> dict[str, int]:
  """What the host launches for one call of a GPU program, from XLA's dump of its thunk sequence
  (`xla_dump_to`, `*.thunk_sequence_after_thunk_passes.txt`): 'cuda_graphs', its command buffers,
  each launched at once with all the kernels inside it, and 'alone', the thunks launched one by
  one outside them (kernels, library calls, copies, loops)."""
  kinds = collections.Counter(_THUNK.findall(thunk_sequence))
  return {'cuda_graphs': kinds.pop('kCommandBuffer', 0), 'alone': sum(kinds.values())}
