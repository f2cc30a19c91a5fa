"""The attention's fused implementations: cuDNN's kernel, or the Pallas kernels of
pallas_attention.py with the query, key and value projected in one product.

`model.MultiHeadAttention` computes attention with `model.dot_product_attention`, the plain form,
unless `applies` says a kernel of config.attention_implementation takes these lengths; then it
calls `fused_attention` with the projections' weights. The first time a kernel replaces the plain
form, and the first time one cannot, a line is logged.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging

from transformer.kernels import pallas_attention

Array = jax.Array


def matrix_product(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """DenseGeneral's dot_general, the last axes of `lhs` with the first of `rhs` (the weights), as
  one [..., K] x [K, N] matrix product; the weights keep their shape. With the heads as axes of
  their own, XLA's GPU matmuls compute the attention's weight gradients transposed, and the sums
  of their split-K parts transpose them back."""
  (_, weight_axes), _ = dimension_numbers
  axes = len(weight_axes)
  flat = lhs.reshape(*lhs.shape[:lhs.ndim - axes], -1)
  out = jax.lax.dot_general(flat, rhs.reshape(flat.shape[-1], -1),
                            (((flat.ndim - 1,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=preferred_element_type)
  return out.reshape(*flat.shape[:-1], *rhs.shape[axes:])


def projection_product(config):
  """The dot_general of the attention's projections: DenseGeneral's (None) or `matrix_product`."""
  return matrix_product if config.attention_projection == 'matrix' else None


class ProjectionWeights(nn.Module):
  """The weights of `nn.DenseGeneral((num_heads, depth), use_bias=False)` over d_model, without
  its product: the same parameter ('kernel'), path and initial values, for `fused_attention` to
  stack."""

  config: object  # the model's TransformerConfig

  @nn.compact
  def __call__(self) -> Array:
    cfg = self.config
    shape = (cfg.d_model, cfg.num_heads, cfg.d_model // cfg.num_heads)
    # Initialised as a [d_model, d_model] matrix, as DenseGeneral does.
    init = lambda rng, shape, dtype: nn.initializers.xavier_uniform()(
        rng, (shape[0], shape[1] * shape[2]), dtype).reshape(shape)
    return self.param('kernel', init, shape, cfg.param_dtype)


_logged = set()


def _log_once(line: str):
  if line not in _logged:
    _logged.add(line)
    logging.info('%s', line)


def applies(config, query_length: int, key_length: int) -> bool:
  """Whether config.attention_implementation's kernel takes queries and keys of these lengths:
  the Pallas kernels rows of up to pallas_attention.MAX_LENGTH, cuDNN's backward pass with a mask
  even lengths. False for 'xla', and while decoding (one position over a cache)."""
  implementation = config.attention_implementation
  if implementation == 'xla' or config.decode:
    return False
  if implementation == 'pallas':
    runs = max(query_length, key_length) <= pallas_attention.MAX_LENGTH
  else:
    runs = query_length % 2 == 0 and key_length % 2 == 0
  _log_once(f'attention: the {implementation} kernels replace model.dot_product_attention'
            if runs else f'attention: model.dot_product_attention for lengths the '
            f'{implementation} kernels do not take ({query_length} queries, {key_length} keys)')
  return runs


def _project(config, x: Array, *weights: Array) -> Array:
  """x [..., d_model] times each [d_model, heads, depth] weight, in one product: [...,
  len(weights), heads, depth] in config.dtype, as DenseGeneral promotes and multiplies."""
  x, stacked = nn.dtypes.promote_dtype(x, jnp.stack(weights, axis=1), dtype=config.dtype)
  product = projection_product(config) or jax.lax.dot_general
  return product(x, stacked, (((x.ndim - 1,), (0,)), ((), ())))


def fused_attention(config, x: Array, memory: Array | None, weights: dict, mask: Array) -> Array:
  """Multi-head attention before the output projection, by config.attention_implementation,
  where `applies`.

  'pallas': the projections of one input in one product, which the kernels read where they lie
  and whose gradients they write into one array, so no input gradients are summed. 'cudnn':
  cuDNN's fused kernel each way instead of XLA's matmuls, mask, softmax and transposes.

  Args:
    config: the model's TransformerConfig (no attention dropout, no projection biases).
    x: [batch, length, d_model] queries.
    memory: the encoder output for cross-attention; None for self-attention.
    weights: the 'query', 'key' and 'value' projections' weights [d_model, heads, depth]
      (`ProjectionWeights`).
    mask: [batch, 1, length, key_length], True where a query may attend.

  Returns:
    [batch, length, heads, depth] in config.dtype.
  """
  if config.attention_implementation == 'pallas':
    if memory is None:
      stacked = _project(config, x, weights['query'], weights['key'], weights['value'])
      inputs = [pallas_attention.Stacked(stacked, i) for i in range(3)]
    else:
      stacked = _project(config, memory, weights['key'], weights['value'])
      inputs = [_project(config, x, weights['query'])[:, :, 0],
                *(pallas_attention.Stacked(stacked, i) for i in range(2))]
    return pallas_attention.attention(*inputs, mask)
  keys_from = x if memory is None else memory
  query = _project(config, x, weights['query'])[:, :, 0]
  key, value = (_project(config, keys_from, weights[name])[:, :, 0] for name in ('key', 'value'))
  return jax.nn.dot_product_attention(query, key, value, mask=mask.astype(bool),
                                      implementation='cudnn')
