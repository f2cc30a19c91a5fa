"""`jax.lax.top_k` by blocks, for the candidates of a beam search or a sampling step."""

import jax
import jax.numpy as jnp


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
