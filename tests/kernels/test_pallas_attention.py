"""The fused attention kernels (Pallas's interpreter on a CPU) against flax's attention composed by
XLA: values, gradients and queries with no key. The model with them: tests/test_model.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import model
from transformer.kernels import pallas_attention

pytestmark = pytest.mark.usefixtures('float32_matmuls')


def _rounding(dtype) -> float:
  """A relative difference within a few roundings of `dtype` (and float32's sums in another
  order)."""
  return {jnp.bfloat16: 2**-6, jnp.float16: 2**-9}.get(dtype, 1e-5)


# Packed rows of two pairs, padding, a row without any, a query row with no key: self-attention
# (32 x 32, causal or not) and cross-attention (12 queries over 8 keys, both padded to 16).
SEGMENTS = {
    'self': (np.array([[1] * 12 + [2] * 14 + [0] * 6, [1] * 32]),) * 2,
    'cross': (np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12]),
              np.array([[1] * 3 + [2] * 4 + [0], [0] * 8])),
}


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize('kind,causal', [('self', False), ('self', True), ('cross', False)])
@pytest.mark.parametrize('backward_rows', [0, 16])  # self-attention's backward: 1 or 2 blocks
@pytest.mark.parametrize('stacked', [False, True])  # the inputs as slots of one projection
def test_the_kernels_compute_what_flax_attention_does(dtype, kind, causal, backward_rows,
                                                      stacked):
  query_segments, key_segments = (jnp.asarray(s) for s in SEGMENTS[kind])
  # The model's mask, segment ids standing for tokens: segment 0 is padding.
  mask = model.attention_mask(query_segments, key_segments, query_segments, key_segments,
                              causal)
  attended = np.asarray(mask.any(-1))[:, 0, :, None, None]  # [batch, queries, 1, 1]
  (batch, queries), keys, heads, depth = query_segments.shape, key_segments.shape[1], 2, 16
  inputs = jax.random.normal(jax.random.key(0), (3, batch, max(queries, keys), heads, depth))
  query = inputs[0, :, :queries].astype(dtype)
  key, value = (x[:, :keys].astype(dtype) for x in inputs[1:])
  # The loss's cotangent: none for a query that attends to nothing (padding, in the model).
  grads = jax.random.normal(jax.random.key(1), query.shape).astype(dtype) * attended

  def flax_attention(query, key, value):
    return nn.dot_product_attention(query, key, value, mask=mask, dtype=dtype,
                                    force_fp32_for_softmax=True).astype(dtype)

  def fused(query, key, value):
    inputs = [query, key, value]
    if stacked:  # the key and value, and the query in self-attention, read from one array
      first = 0 if kind == 'self' else 1
      array = jnp.stack(inputs[first:], axis=2)
      inputs[first:] = [pallas_attention.Stacked(array, i) for i in range(3 - first)]
    return pallas_attention.attention(*inputs, mask, backward_rows=backward_rows)

  results = []
  for attention in (flax_attention, fused):
    out, backward = jax.vjp(attention, query, key, value)
    results.append((out, *backward(grads)))
  (want, *want_grads), (got, *got_grads) = results
  assert got.dtype == dtype and got.shape == query.shape
  np.testing.assert_allclose(np.asarray(got, np.float32) * attended,
                             np.asarray(want, np.float32) * attended,
                             atol=4 * _rounding(dtype), rtol=4 * _rounding(dtype))
  assert not np.asarray(got)[~np.broadcast_to(attended, got.shape)].any()  # zeros, not averages
  for name, want, got in zip(('query', 'key', 'value'), want_grads, got_grads):
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    assert got.dtype == want.dtype and np.isfinite(got).all()
    assert np.linalg.norm(got - want) <= _rounding(dtype) * np.linalg.norm(want), name


def test_rows_longer_than_the_kernels_take_are_refused():
  query = jnp.zeros((1, pallas_attention.MAX_LENGTH + 1, 1, 16))
  mask = jnp.ones((1, 1, query.shape[1], query.shape[1]))
  with pytest.raises(ValueError, match='up to 128 positions, not 129 queries over 129 keys'):
    pallas_attention.attention(query, query, query, mask)
