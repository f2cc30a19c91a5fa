"""Faster implementations of the model's ops: the same results, fewer passes over memory.

`transformer/model.py` calls each at one site, beside the plain form it replaces; README.md in
this folder says what each buys and how to switch it off. The per-machine choice is `choice.py`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.kernels import hash_rng, pallas_attention

Array = jax.Array


def matrix_product(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """DenseGeneral's dot_general, the last axes of `lhs` with the first of `rhs` (the kernel), as
  one [..., K] x [K, N] matrix product; the kernel keeps its shape. With the heads as axes of
  their own, XLA's GPU matmuls compute the attention's weight gradients transposed, and the sums
  of their split-K parts transpose them back."""
  (_, kernel_axes), _ = dimension_numbers
  axes = len(kernel_axes)
  flat = lhs.reshape(*lhs.shape[:lhs.ndim - axes], -1)
  out = jax.lax.dot_general(flat, rhs.reshape(flat.shape[-1], -1),
                            (((flat.ndim - 1,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=preferred_element_type)
  return out.reshape(*flat.shape[:-1], *rhs.shape[axes:])


def projection_product(config):
  """The dot_general of the attention's projections: DenseGeneral's (None) or `matrix_product`."""
  return matrix_product if config.attention_projection == 'matrix' else None


class ProjectionKernel(nn.Module):
  """The kernel of `nn.DenseGeneral((num_heads, depth), use_bias=False)` over d_model, without its
  product: the same parameter, path and initial values, for `attention` to stack."""

  config: object  # the model's TransformerConfig

  @nn.compact
  def __call__(self) -> Array:
    cfg = self.config
    shape = (cfg.d_model, cfg.num_heads, cfg.d_model // cfg.num_heads)
    # Initialised as a [d_model, d_model] matrix, as DenseGeneral does.
    init = lambda rng, shape, dtype: nn.initializers.xavier_uniform()(
        rng, (shape[0], shape[1] * shape[2]), dtype).reshape(shape)
    return self.param('kernel', init, shape, cfg.param_dtype)


def _project(config, x: Array, *kernels: Array) -> Array:
  """x [..., d_model] times each [d_model, heads, depth] kernel, in one product: [...,
  len(kernels), heads, depth] in config.dtype, as DenseGeneral promotes and multiplies."""
  x, kernel = nn.dtypes.promote_dtype(x, jnp.stack(kernels, axis=1), dtype=config.dtype)
  product = projection_product(config) or jax.lax.dot_general
  return product(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _even(query: Array, key: Array) -> bool:
  """Whether both lengths are even: cuDNN's backward pass with a mask needs them so."""
  return query.shape[1] % 2 == 0 and key.shape[1] % 2 == 0


def attention(config, x: Array, memory: Array | None, kernels: dict, mask: Array) -> Array:
  """Multi-head attention before the output projection, by config.attention_implementation.

  'pallas' (rows of up to pallas_attention.MAX_LENGTH): the projections of one input in one
  product, which the kernels read where they lie and whose gradients they write into one array,
  so no input gradients are summed. 'cudnn': cuDNN's fused kernel each way instead of XLA's
  matmuls, mask, softmax and transposes. Where neither applies, XLA's attention.

  Args:
    config: the model's TransformerConfig (no attention dropout).
    x: [batch, length, d_model] queries.
    memory: the encoder output for cross-attention; None for self-attention.
    kernels: the 'query', 'key' and 'value' projections' kernels [d_model, heads, depth].
    mask: [batch, 1, length, key_length], True where a query may attend.

  Returns:
    [batch, length, heads, depth] in config.dtype.
  """
  keys_from = x if memory is None else memory
  if (config.attention_implementation == 'pallas' and
      max(x.shape[1], keys_from.shape[1]) <= pallas_attention.MAX_LENGTH):
    if memory is None:
      stacked = _project(config, x, kernels['query'], kernels['key'], kernels['value'])
      inputs = [pallas_attention.Stacked(stacked, i) for i in range(3)]
    else:
      stacked = _project(config, memory, kernels['key'], kernels['value'])
      inputs = [_project(config, x, kernels['query'])[:, :, 0],
                *(pallas_attention.Stacked(stacked, i) for i in range(2))]
    return pallas_attention.attention(*inputs, mask)
  query = _project(config, x, kernels['query'])[:, :, 0]
  key, value = (_project(config, keys_from, kernels[name])[:, :, 0] for name in ('key', 'value'))
  if config.attention_implementation == 'cudnn' and _even(query, key):
    return jax.nn.dot_product_attention(query, key, value, mask=mask.astype(bool),
                                        implementation='cudnn')
  return nn.dot_product_attention(query, key, value, mask=mask, dtype=config.dtype,
                                  force_fp32_for_softmax=True)


def is_hash_key(key: Array) -> bool:
  """Whether `key` is a typed key of hash_rng's generator (config.dropout_rng_impl='hash')."""
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and (
      jax.random.key_impl(key) == hash_rng.IMPL)


def _masked(x: Array, keep: Array, rate: float) -> Array:
  """nn.Dropout's output for the keep mask `keep`: kept values scaled by 1 / (1 - rate)."""
  return jax.lax.select(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _hash_dropped(x: Array, words: tuple[Array, Array], rate: float) -> Array:
  return _masked(x, hash_rng.kept(hash_rng.bits(words, x.shape), 1.0 - rate), rate)


def _hash_dropped_grads(rate: float, words: tuple[Array, Array], grads: Array):
  # The barrier keeps XLA from finding the forward's draw in this one and keeping it after all.
  return _hash_dropped(grads, jax.lax.optimization_barrier(words), rate), None


_hash_dropout = jax.custom_vjp(_hash_dropped, nondiff_argnums=(2,))
_hash_dropout.defvjp(lambda x, words, rate: (_hash_dropped(x, words, rate), words),
                     _hash_dropped_grads)


def dropout(x: Array, key: Array, rate: float) -> Array:
  """nn.Dropout's output for a hash_rng key, its mask drawn again in the backward pass rather
  than kept: a few integer operations per element that fuse into the kernels on either side, so
  the mask is neither written nor read."""
  return _hash_dropout(x, hash_rng.mixed_words(jax.random.key_data(key)), rate)


@jax.custom_jvp
def relu(x: Array) -> Array:
  """max(0, x), its derivative read from the output rather than the input (jax.nn.relu's): the
  backward pass then keeps no pre-activation, and XLA can fuse the ReLU into the matmul before
  it (on a GPU, cuBLAS's bias-and-ReLU epilogue) instead of a pass of its own."""
  return jnp.maximum(x, 0)


# `out != 0`, not `out > 0`: XLA rewrites max(x, 0) > 0 as x > 0, which needs the pre-activation.
relu.defjvps(lambda tangent, out, x: jnp.where(out != 0, tangent, 0))


def _logits(states, table):
  return jnp.einsum('...d,vd->...v', states, table.astype(states.dtype),
                    preferred_element_type=jnp.float32)


def _logits_gradients(residuals, grads):
  """The products in the states' dtype, summed in float32, as the forward's: autodiff would
  multiply the float32 logit gradients with the low-precision operands in float32."""
  states, table = residuals
  dtype = states.dtype
  grads = grads.astype(dtype)
  return (jnp.einsum('...v,vd->...d', grads, table.astype(dtype),
                     preferred_element_type=jnp.float32).astype(dtype),
          jnp.einsum('...v,...d->vd', grads, states,
                     preferred_element_type=jnp.float32).astype(table.dtype))


low_precision_logits = jax.custom_vjp(_logits)
low_precision_logits.defvjp(lambda states, table: (_logits(states, table), (states, table)),
                            _logits_gradients)
low_precision_logits.__doc__ = """Float32 logits of bfloat16 or float16 `states` [..., d_model]
against a table [vocab, d_model]: the operands in the states' dtype run at the matrix units' full
rate, the products sum in float32, each way."""


def top_k(x, k: int, block: int = 128):
  """`jax.lax.top_k` over the last axis of x [rows, n]: the same values and indices, ties going
  to the lower index.

  One pass takes the maximum of each block of `block` elements; the k largest lie in the k blocks
  of largest maximum (each block ranked before an element's own holds an element ranked before
  it), whose elements then go through `lax.top_k`. A max over blocks vectorises, where lax.top_k
  over a whole vocabulary of beam candidates is a slow pass on CPUs.
  """
  rows, n = x.shape
  blocks = -(-n // block)
  if blocks <= 2 * k:
    return jax.lax.top_k(x, k)
  grouped = jnp.pad(x, ((0, 0), (0, blocks * block - n)), constant_values=-jnp.inf).reshape(
      rows, blocks, block)
  _, top_blocks = jax.lax.top_k(grouped.max(axis=-1), k)
  top_blocks = jnp.sort(top_blocks, axis=-1)  # candidates in index order: ties as lax.top_k
  candidates = jnp.take_along_axis(grouped, top_blocks[:, :, None], axis=1).reshape(rows, -1)
  values, positions = jax.lax.top_k(candidates, k)
  block_of = jnp.take_along_axis(top_blocks, positions // block, axis=1)
  return values, block_of * block + positions % block
