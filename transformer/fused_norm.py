"""A post-norm sub-layer's end, LayerNorm(residual + dropout(sublayer output)), in one Pallas
kernel each way.

XLA computes it in two kernels forward (the dropout and the residual's sum, which writes the sum,
then the statistics and the normalisation, which read it again) and two backward, with the
layer norm's row statistics between passes (docs/speed.md). Here a block of whole rows stays in
registers: the forward pass reads the two inputs once and writes the output, and the backward pass
reads them and the output's gradient once and writes both gradients. Nothing is kept for the
backward pass but its inputs and the row statistics: the sum is formed again, and the dropout
mask drawn again from the 'hash' key (transformer/hash_rng.py). Values are those of
`model.dropout` and flax's `nn.LayerNorm` composed, each step rounded as XLA rounds it;
gradients agree within a rounding (tests/test_fused_norm.py). No library fuses the dropout and
the residual into its layer norm, hence this kernel.

Written on Pallas's Triton lowering, which jax compiles for GPUs, also without one for
`benchmarks.gpu_plan` (jax 0.11 warns that it is deprecated; Mosaic GPU's lowering needs a GPU to
develop on). Elsewhere the kernels run in Pallas's interpreter, slowly, for tests.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from transformer import hash_rng

Array = jax.Array


def _keep_mask(key_ref, block: int, rows: int, width: int, rate: float) -> Array:
  """Dropout's keep mask of a block of rows, as `model.dropout` draws it over the flat index."""
  row = jax.lax.broadcasted_iota(jnp.uint32, (rows, width), 0) + (block * rows).astype(jnp.uint32)
  column = jax.lax.broadcasted_iota(jnp.uint32, (rows, width), 1)
  words = hash_rng.mixed_words([key_ref[0], key_ref[1]])  # per program: a few operations
  return hash_rng.kept(hash_rng.bits_of_index(row * jnp.uint32(width) + column, words), 1.0 - rate)


def _dropped(value: Array, keep: Array | None, rate: float, dtype) -> Array:
  """value / (1 - rate) where kept, else 0, rounded to `dtype` as XLA's `x / keep` in it is."""
  if keep is None:
    return value
  divisor = float(np.asarray(1.0 - rate, dtype))  # a Python float takes the array's dtype
  return jnp.where(keep, (value / divisor).astype(dtype).astype(jnp.float32), 0.0)


def _sum(key_ref, residual_ref, sublayer_ref, rate: float):
  """The float32 sum residual + dropout(sublayer) of a block, rounded to the residual's dtype;
  and the keep mask (None without dropout)."""
  rows, width = residual_ref.shape
  keep = None if rate == 0.0 else _keep_mask(key_ref, pl.program_id(0), rows, width, rate)
  dropped = _dropped(sublayer_ref[...].astype(jnp.float32), keep, rate, sublayer_ref.dtype)
  total = residual_ref[...].astype(jnp.float32) + dropped
  return total.astype(residual_ref.dtype).astype(jnp.float32), keep


def _post_norm_forward_kernel(key_ref, residual_ref, sublayer_ref, scale_ref, bias_ref, out_ref,
                              mean_ref, rstd_ref, *, rate: float, epsilon: float):
  total, _ = _sum(key_ref, residual_ref, sublayer_ref, rate)
  mean = jnp.mean(total, axis=1)
  centred = total - mean[:, None]
  rstd = jax.lax.rsqrt(jnp.mean(centred * centred, axis=1) + epsilon)
  out = centred * rstd[:, None] * scale_ref[...][None, :] + bias_ref[...][None, :]
  out_ref[...] = out.astype(out_ref.dtype)
  mean_ref[...] = mean
  rstd_ref[...] = rstd


def _post_norm_backward_kernel(key_ref, residual_ref, sublayer_ref, grads_ref, mean_ref, rstd_ref,
                               scale_ref, d_residual_ref, d_sublayer_ref, d_scale_ref, d_bias_ref,
                               *, rate: float):
  total, keep = _sum(key_ref, residual_ref, sublayer_ref, rate)
  rstd = rstd_ref[...][:, None]
  normalised = (total - mean_ref[...][:, None]) * rstd
  grads = grads_ref[...].astype(jnp.float32)
  d_normalised = grads * scale_ref[...][None, :]
  d_total = rstd * (d_normalised - jnp.mean(d_normalised, axis=1, keepdims=True) -
                    normalised * jnp.mean(d_normalised * normalised, axis=1, keepdims=True))
  d_total = d_total.astype(d_residual_ref.dtype)
  d_residual_ref[...] = d_total
  d_sublayer = _dropped(d_total.astype(jnp.float32), keep, rate, d_sublayer_ref.dtype)
  d_sublayer_ref[...] = d_sublayer.astype(d_sublayer_ref.dtype)
  d_scale_ref[...] = jnp.sum(grads * normalised, axis=0)[None, :]
  d_bias_ref[...] = jnp.sum(grads, axis=0)[None, :]


def block_rows(rows: int) -> int:
  """Rows per kernel program: the largest of 16, 8, ... 1 that divides `rows`."""
  return next(block for block in (16, 8, 4, 2, 1) if rows % block == 0)


def warps(block: int, width: int) -> int:
  """Triton's warps per program: 16 of a block's values a thread, from 1 to 16 warps. Triton's
  default of 4 spilled the backward pass's registers at 16 x 512 and left an H100's SM 8 warps of
  it; with 16, 16 warps and none spilled (`python -m benchmarks.gpu_plan`'s Triton table)."""
  return min(16, max(1, block * width // (32 * 16)))


def _call(kernel, inputs, outputs, rows: int, width: int, interpret: bool):
  """`kernel` over blocks of whole rows. `inputs` are (array, kind) and `outputs` (dtype, kind),
  of kinds 'key' (the key's data, uint32[2], whole), 'vector' ([width], whole), 'rows' ([rows,
  width] by blocks), 'stats' ([rows] by blocks) and 'partial' ([rows / block, width], a row per
  block)."""
  block = block_rows(rows)
  specs = {'key': pl.BlockSpec((2,), lambda i: (0,)),
           'vector': pl.BlockSpec((width,), lambda i: (0,)),
           'rows': pl.BlockSpec((block, width), lambda i: (i, 0)),
           'stats': pl.BlockSpec((block,), lambda i: (i,)),
           'partial': pl.BlockSpec((1, width), lambda i: (i, 0))}
  shapes = {'rows': (rows, width), 'stats': (rows,), 'partial': (rows // block, width)}
  return pl.pallas_call(
      kernel, grid=(rows // block,),
      out_shape=[jax.ShapeDtypeStruct(shapes[kind], dtype) for dtype, kind in outputs],
      in_specs=[specs[kind] for _, kind in inputs], out_specs=[specs[kind] for _, kind in outputs],
      compiler_params=plgpu.CompilerParams(num_warps=warps(block, width)),
      interpret=interpret)(*(array for array, _ in inputs))


def _forward(residual, sublayer, scale, bias, key_data, rate, epsilon, interpret):
  rows, width = residual.shape
  kernel = functools.partial(_post_norm_forward_kernel, rate=rate, epsilon=epsilon)
  out, mean, rstd = _call(
      kernel, [(key_data, 'key'), (residual, 'rows'), (sublayer, 'rows'), (scale, 'vector'),
               (bias, 'vector')],
      [(residual.dtype, 'rows'), (jnp.float32, 'stats'), (jnp.float32, 'stats')], rows, width,
      interpret)
  return out, (residual, sublayer, scale, key_data, mean, rstd)


def _backward(rate, epsilon, interpret, saved, grads):
  del epsilon  # in the saved statistics
  residual, sublayer, scale, key_data, mean, rstd = saved
  rows, width = residual.shape
  kernel = functools.partial(_post_norm_backward_kernel, rate=rate)
  d_residual, d_sublayer, d_scale, d_bias = _call(
      kernel, [(key_data, 'key'), (residual, 'rows'), (sublayer, 'rows'), (grads, 'rows'),
               (mean, 'stats'), (rstd, 'stats'), (scale, 'vector')],
      [(residual.dtype, 'rows'), (sublayer.dtype, 'rows'), (jnp.float32, 'partial'),
       (jnp.float32, 'partial')], rows, width, interpret)
  return d_residual, d_sublayer, d_scale.sum(0), d_bias.sum(0), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _post_norm(residual, sublayer, scale, bias, key_data, rate, epsilon, interpret):
  return _forward(residual, sublayer, scale, bias, key_data, rate, epsilon, interpret)[0]


_post_norm.defvjp(_forward, _backward)


def post_norm(residual: Array, sublayer: Array, scale: Array, bias: Array, key_data, rate: float,
              epsilon: float) -> Array:
  """LayerNorm(residual + dropout(sublayer)) over the last axis, in the residual's dtype.

  Args:
    residual, sublayer: [..., width] arrays of one dtype; width a power of 2 (Triton's blocks).
    scale, bias: the layer norm's [width] parameters (float32).
    key_data: the data (uint32[2]) of the dropout's 'hash' key, or None when rate is 0.
    rate: the dropout rate.
    epsilon: the layer norm's epsilon.
  """
  shape, width = residual.shape, residual.shape[-1]
  key_data = jnp.zeros(2, jnp.uint32) if key_data is None else key_data
  interpret = jax.default_backend() != 'gpu'
  out = _post_norm(residual.reshape(-1, width), sublayer.reshape(-1, width), scale, bias, key_data,
                   float(rate), float(epsilon), interpret)
  return out.reshape(shape)
