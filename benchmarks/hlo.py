"""Reading XLA's optimized HLO text: what each instruction computes, which kernels a step
launches, and how split-K matmuls' partial products are summed."""

import collections
import re

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
      if dots or re.search(r'custom_call_target="[^"]*(gemm|matmul)', line):  # or cuBLAS's
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


_KERNEL = re.compile(r'^\s+(?:ROOT )?%([\w.\-]+) = .*? (fusion|custom-call)\(', re.M)
# A split-K matmul's partial products: a Triton fusion's output, or a cuBLAS call's first.
_SPLIT_K = re.compile(r'^\s+%([\w.\-]+) = f32\[(\d+),\d+,\d+\]\{2,1,0\} '
                      r'(?:fusion\([^\n]*kind=kCustom|get-tuple-element\(%custom-call)', re.M)
_FUSION = re.compile(r'^\s+(?:ROOT )?%[\w.\-]+ = .*? fusion\(([^)]*)\)[^\n]*calls=%([\w.\-]+)',
                     re.M)
_SUM_OF_PARTS = re.compile(r'= f32\[\d+,\d+\]\{(\d,\d)\} reduce\([^\n]*dimensions=\{0\}')


def _entry(hlo: str) -> str:
  return hlo[hlo.index('\nENTRY'):]


def kernels_by_class(hlo: str) -> dict[str, int]:
  """The kernels one call of an optimized GPU HLO module launches (its entry computation's
  fusions and library calls), counted by their `hlo_classes`."""
  classes = hlo_classes(hlo)
  counts = collections.Counter(classes.get(name, ('other',))[0]
                               for name, _ in _KERNEL.findall(_entry(hlo)))
  return dict(sorted(counts.items()))


def split_k_sums(hlo: str) -> list[dict]:
  """The sums of split-K matmuls' partial products, f32[parts, m, n], in an optimized GPU HLO
  module: per sum, the parts and whether it writes them transposed ({0,1} where the matmul
  wrote {2,1,0}), a sum that reads across rows."""
  entry = _entry(hlo)
  matmuls = dict(_SPLIT_K.findall(entry))
  sums = []
  for operands, computation in _FUSION.findall(entry):
    parts = [matmuls[m] for m in re.findall(r'%([\w.\-]+)', operands) if m in matmuls]
    body = re.search(r'^%' + re.escape(computation) + r' .*?^\}', hlo, re.M | re.S)
    reduction = body and _SUM_OF_PARTS.search(body.group(0))
    if parts and reduction:
      sums.append({'parts': int(parts[0]), 'transposed': reduction.group(1) == '0,1'})
  return sums
