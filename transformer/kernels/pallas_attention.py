"""Scaled dot-product attention over rows of up to 128 positions, one Pallas kernel each way.

cuDNN's flash attention (`implementation.attention='cudnn'`) walks each row in tiles, with
an online softmax forward and, backward, a pass for the output's row sums and a float32 query
gradient accumulated across tiles and converted after; at 128 positions a row fits one program
(docs/speed.md has what that bought). Here one program per (batch row, head) holds the whole
[queries, keys] score matrix: forward it reads the query, key, value and mask once and writes the
output and the row log-normalisers; backward it reads them and the output's gradient once and
writes the three gradients. The mask is [batch, queries, keys] int8,
read by each head's program from the L2 cache (the heads of a row run side by side). The query,
key and value may be slots of one array of projections (`Stacked`), read where they lie, their
gradients written into one array: the model projects an input once for all of them and sums no
input gradients. No library kernel takes a mask or separate query and key segments (jax's Pallas
`mha` takes one segment array, for self-attention), hence this kernel.

Written on Pallas's Triton lowering (a GPU); elsewhere the kernels run in Pallas's interpreter,
slowly, for tests.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array

MAX_LENGTH = 128  # a [128, 128] float32 score matrix per program; longer rows need tiles


def _padded(length: int) -> int:
  """Triton's blocks are powers of 2, and its matrix products need 16 rows or more."""
  return max(16, 1 << (length - 1).bit_length())


def _dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
  """a @ b over the given axes of each 2-D block, accumulated in float32 (float32 blocks
  multiplied in float32, not Triton's default TensorFloat-32)."""
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)


def _scores(query: Array, key: Array, mask: Array, scale: float):
  """The float32 scaled scores with masked ones at float32's minimum, and where they are not."""
  allowed = mask != 0
  scores = _dot(query, key, (1, 1)) * scale
  return jnp.where(allowed, scores, jnp.finfo(jnp.float32).min), allowed


def _attention_forward_kernel(q_ref, k_ref, v_ref, mask_ref, out_ref, normaliser_ref, *,
                              scale: float):
  scores, allowed = _scores(q_ref[...], k_ref[...], mask_ref[...], scale)
  top = jnp.max(scores, axis=1)
  weights = jnp.where(allowed, jnp.exp(scores - top[:, None]), 0.0)
  total = jnp.sum(weights, axis=1)
  total = jnp.where(total > 0, total, 1.0)  # a query with no key attends to nothing: output 0
  out = _dot(weights.astype(v_ref.dtype), v_ref[...], (1, 0)) / total[:, None]
  out_ref[...] = out.astype(out_ref.dtype)
  normaliser_ref[...] = top + jnp.log(total)


def _attention_backward_kernel(q_ref, k_ref, v_ref, mask_ref, d_out_ref, normaliser_ref,
                               *grad_refs, slots, scale: float, rows: int):
  """The gradients, `rows` queries at a time (their key and value gradients summed in float32
  across the blocks, which takes registers too), each written to its slot of its stack's
  gradient (`grad_refs`, [length, slots, depth] blocks)."""
  (q_stack, q_slot), (k_stack, k_slot), (v_stack, v_slot) = slots
  key, value = k_ref[...], v_ref[...]

  def step(block, sums):
    d_key, d_value = sums
    at = pl.ds(block * rows, rows)
    query, d_out = q_ref[at, :], d_out_ref[at, :]
    scores, allowed = _scores(query, key, mask_ref[at, :], scale)
    weights = jnp.where(allowed, jnp.exp(scores - normaliser_ref[at][:, None]), 0.0)
    d_value += _dot(weights.astype(d_out.dtype), d_out, (0, 0))
    d_weights = _dot(d_out, value, (1, 1))
    # The softmax's backward, with each row's sum of weights * d_weights from the unrounded
    # float32 products: flash attention's sum of out * d_out, from the output rounded to
    # bfloat16, loses the gradients' small differences to its rounding.
    row_sums = jnp.sum(weights * d_weights, axis=1)
    d_scores = (weights * (d_weights - row_sums[:, None]) * scale).astype(query.dtype)
    d_q_ref = grad_refs[q_stack]
    d_q_ref[at, q_slot, :] = _dot(d_scores, key, (1, 0)).astype(d_q_ref.dtype)
    return d_key + _dot(d_scores, query, (0, 0)), d_value

  zeros = jnp.zeros(key.shape, jnp.float32)
  d_key, d_value = jax.lax.fori_loop(0, q_ref.shape[0] // rows, step, (zeros, zeros))
  grad_refs[k_stack][:, k_slot, :] = d_key.astype(grad_refs[k_stack].dtype)
  grad_refs[v_stack][:, v_slot, :] = d_value.astype(grad_refs[v_stack].dtype)


def _call(kernel, inputs, outputs, warps: int, interpret: bool):
  """`kernel` over a (heads, batch) grid: a program per head of each batch row. `inputs` are
  (array, kind) and `outputs` (shape, dtype, kind), of kinds 'heads' ([batch, length, heads,
  depth]), an int s (slot s of a stack, [batch, length, slots, heads, depth]), 'stack' (all its
  slots), 'mask' ([batch, queries, keys]) and 'rows' ([batch, heads, queries])."""
  batch, heads = inputs[0][0].shape[0], inputs[0][0].shape[-2]
  slot_spec = lambda slot: lambda shape: pl.BlockSpec((None, shape[1], None, None, shape[4]),
                                                      lambda h, b: (b, 0, slot, h, 0))
  specs = {'heads': lambda shape: pl.BlockSpec((None, shape[1], None, shape[3]),
                                               lambda h, b: (b, 0, h, 0)),
           'stack': lambda shape: pl.BlockSpec((None, shape[1], shape[2], None, shape[4]),
                                               lambda h, b: (b, 0, 0, h, 0)),
           'mask': lambda shape: pl.BlockSpec((None, *shape[1:]), lambda h, b: (b, 0, 0)),
           'rows': lambda shape: pl.BlockSpec((None, None, shape[2]), lambda h, b: (b, h, 0))}
  spec = lambda kind: slot_spec(kind) if isinstance(kind, int) else specs[kind]
  return pl.pallas_call(
      kernel, grid=(heads, batch),
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _ in outputs],
      in_specs=[spec(kind)(array.shape) for array, kind in inputs],
      out_specs=[spec(kind)(shape) for shape, _, kind in outputs],
      compiler_params=plgpu.CompilerParams(num_warps=warps),
      interpret=interpret)(*(array for array, _ in inputs))


def _inputs(stacks, slots):
  """The query, key and value as `_call`'s inputs: each its slot of its stack."""
  return [(stacks[stack], slot) for stack, slot in slots]


def _forward(stacks, mask, slots, warps, backward_rows, interpret):
  del backward_rows  # the backward pass's
  query = stacks[slots[0][0]]
  batch, length, _, heads, depth = query.shape
  kernel = functools.partial(_attention_forward_kernel, scale=depth**-0.5)
  out, normaliser = _call(
      kernel, [*_inputs(stacks, slots), (mask, 'mask')],
      [((batch, length, heads, depth), query.dtype, 'heads'),
       ((batch, heads, length), jnp.float32, 'rows')],
      warps, interpret)
  return out, (stacks, mask, normaliser)


def _backward(slots, warps, backward_rows, interpret, saved, d_out):
  stacks, mask, normaliser = saved
  queries, depth = d_out.shape[1], d_out.shape[-1]
  kernel = functools.partial(_attention_backward_kernel, slots=slots, scale=depth**-0.5,
                             rows=min(backward_rows or queries, queries))
  grads = _call(
      kernel, [*_inputs(stacks, slots), (mask, 'mask'), (d_out, 'heads'), (normaliser, 'rows')],
      [(stack.shape, stack.dtype, 'stack') for stack in stacks], warps, interpret)
  return tuple(grads), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _attention(stacks, mask, slots, warps, backward_rows, interpret):
  return _forward(stacks, mask, slots, warps, backward_rows, interpret)[0]


_attention.defvjp(_forward, _backward)


class Stacked(NamedTuple):
  """Projection `index` of `array`, [batch, length, projections, heads, depth]: read where it
  lies, its gradient written into one array with the others' (one matmul each way for the
  projections together, and no sum of their input gradients)."""
  array: Array
  index: int


def attention(query: Array, key: Array, value: Array, mask: Array, warps: int = 8,
              backward_rows: int = 0) -> Array:
  """softmax(query key^T / sqrt(depth)) value over the keys a query may attend to.

  What `nn.dot_product_attention` computes without dropout, with the scores and softmax in float32
  and the weights rounded to the values' dtype; a query with no key to attend to gets zeros (and
  zero gradients) where nn.dot_product_attention averages all values. Both lengths are at most
  MAX_LENGTH; shorter ones are padded to a power of 2 from 16.

  Args:
    query: [batch, queries, heads, depth]; depth a power of 2 from 16 (Triton's blocks). Or a
      `Stacked` projection, as key and value may be too.
    key, value: [batch, keys, heads, depth], the query's dtype.
    mask: [batch, 1, queries, keys], nonzero where a query may attend to a key.
    warps: Triton's warps per program. With 8, a [128, 128] float32 matrix is 64 registers a
      thread, and the backward holds two, without spilling; 8 with backward_rows 0 was the
      fastest setting timed (docs/speed.md).
    backward_rows: queries the backward pass takes at a time (a power of 2 from 16), its key and
      value gradients summed over them; 0: all at once.

  Returns:
    [batch, queries, heads, depth] in the query's dtype.
  """
  stacks, slots = [], []
  for x in (query, key, value):  # each a slot of a stack: a Stacked one's, or its own
    array, slot = x if isinstance(x, Stacked) else (x[:, :, None], 0)
    if not any(array is stack for stack in stacks):
      stacks.append(array)
    slots.append((next(i for i, stack in enumerate(stacks) if stack is array), slot))
  queries, keys = stacks[slots[0][0]].shape[1], stacks[slots[1][0]].shape[1]
  if max(queries, keys) > MAX_LENGTH:
    raise ValueError(f'fused attention takes rows of up to {MAX_LENGTH} positions, not '
                     f'{queries} queries over {keys} keys')
  pad = lambda x: jnp.pad(x, [(0, 0), (0, _padded(x.shape[1]) - x.shape[1])] + [(0, 0)] * 3)
  mask = mask[:, 0].astype(jnp.int8)
  mask = jnp.pad(mask, [(0, 0), (0, _padded(queries) - queries), (0, _padded(keys) - keys)])
  out = _attention(tuple(map(pad, stacks)), mask, tuple(slots), warps, backward_rows,
                   jax.default_backend() != 'gpu')
  return out[:, :queries]
