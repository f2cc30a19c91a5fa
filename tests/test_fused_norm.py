"""The fused post-norm kernels (Pallas's interpreter on a CPU) against dropout, the residual sum
and flax's layer norm composed by XLA: values, gradients, and the model either way."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import fused_norm, hash_rng, model
from transformer.model import Transformer, TransformerConfig

pytestmark = pytest.mark.usefixtures('float32_matmuls')

INTERPRETED = jax.default_backend() != 'gpu'  # Pallas's interpreter runs the kernels' jax ops


def _rounding(dtype) -> float:
  """A relative difference within one rounding of `dtype` (and float32's sums in another order)."""
  return 2**-8 if dtype == jnp.bfloat16 else 1e-6


def _inputs(dtype, shape=(3, 16, 128)):
  keys = jax.random.split(jax.random.key(0), 5)
  residual, sublayer, grads = (jax.random.normal(k, shape).astype(dtype) for k in keys[:3])
  scale = 1 + 0.1 * jax.random.normal(keys[3], shape[-1:])
  bias = 0.1 * jax.random.normal(keys[4], shape[-1:])
  return residual, sublayer, scale, bias, grads


@pytest.mark.parametrize('dtype, excess_precision',
                         [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)])
@pytest.mark.parametrize('rate', [0.1, 0.0])
def test_the_kernels_compute_dropout_the_residual_sum_and_layer_norm(dtype, excess_precision,
                                                                     rate):
  residual, sublayer, scale, bias, grads = _inputs(dtype)
  key = jax.random.key(5, impl=hash_rng.IMPL)
  key_data = jax.random.key_data(key)

  def composed(residual, sublayer, scale, bias):
    # XLA on a GPU may carry dropout's quotient into the sum unrounded (excess precision) where
    # the kernel rounds it: with excess_precision, the sum in float32 rounded once, as there.
    inputs = [x.astype(jnp.float32) if excess_precision else x for x in (residual, sublayer)]
    dropped = model.dropout(inputs[1], key, rate) if rate else inputs[1]
    return nn.LayerNorm(epsilon=1e-6, dtype=dtype).apply(
        {'params': {'scale': scale, 'bias': bias}}, (inputs[0] + dropped).astype(dtype))

  def fused(residual, sublayer, scale, bias):
    return fused_norm.post_norm(residual, sublayer, scale, bias, key_data if rate else None, rate,
                                1e-6)

  (expected, expected_vjp), (out, vjp) = (jax.vjp(f, residual, sublayer, scale, bias)
                                          for f in (composed, fused))
  # A bfloat16 sum a rounding apart: explicitly, or on a GPU by XLA's choice.
  sums_apart = dtype == jnp.bfloat16 and (excess_precision or not INTERPRETED)
  if dtype == jnp.bfloat16 and not sums_apart:  # each step rounded as XLA rounds it: to the bit
    np.testing.assert_array_equal(out, expected)
  else:
    # flax's variance is E[x^2] - E[x]^2, the kernel's E[(x - E[x])^2], summed its own way; a sum
    # a rounding apart is a step of it over the rows' deviation (2.1 roundings, excess_precision's).
    np.testing.assert_allclose(out, expected, rtol=0,
                               atol=4 * _rounding(dtype) * np.abs(expected).max())
  for name, got, want in zip(('residual', 'sublayer', 'scale', 'bias'), vjp(grads),
                             expected_vjp(grads)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if name == 'bias' or dtype == jnp.float32 or (name == 'scale' and not sums_apart):
      # float32 throughout
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=name)
    else:
      # The layer norm's gradient formula in another order: a bfloat16 rounding apart. With the
      # sums apart, the scale's (grads times the normalised sum, over rows) within one too, and
      # the sublayer's, the sum's through dropout's quotient rounded again, within two.
      roundings = 2 if name == 'sublayer' and sums_apart else 1
      np.testing.assert_allclose(got, want, rtol=0, atol=roundings * 2**-7 * np.abs(want).max(),
                                 err_msg=name)
  if rate:  # the kernel drops what model.dropout drops (and keeps the rest: the tolerances above)
    dropped = np.asarray(model.dropout(jnp.ones(sublayer.shape), key, rate)) == 0
    assert 0.05 < dropped.mean() < 0.15
    np.testing.assert_array_equal(np.asarray(vjp(grads)[1])[dropped], 0)


def test_blocks_of_rows_divide_the_rows():
  assert [fused_norm.block_rows(rows) for rows in (202 * 128, 48, 6, 7)] == [16, 16, 2, 1]
  # A thread holds 16 values of a block, with 1 to 16 warps.
  assert [fused_norm.warps(16, width) for width in (512, 256, 1024, 32)] == [16, 8, 16, 1]


SMALL = TransformerConfig(vocab_size=23, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                          num_decoder_layers=2, dropout_rate=0.3, deterministic=False)


def _logits_and_grads(config, params, impl):
  sources = jax.random.randint(jax.random.key(0), (2, 6), 1, 23)
  targets = jax.random.randint(jax.random.key(1), (2, 5), 1, 23)
  rngs = {'dropout': jax.random.key(7, impl=impl)}
  logits, vjp = jax.vjp(
      lambda p: Transformer(config).apply({'params': p}, sources, targets, rngs=rngs), params)
  return logits, vjp(jnp.ones_like(logits))[0]


@pytest.mark.parametrize('impl', [hash_rng.IMPL, 'threefry2x32'])
def test_a_model_trains_alike_with_the_fused_layer_norm(impl):
  sources = jnp.ones((1, 4), jnp.int32)
  params = Transformer(SMALL).init(jax.random.key(2), sources, sources)['params']
  fused_params = Transformer(SMALL.replace(norm_implementation='pallas')).init(
      jax.random.key(2), sources, sources)['params']
  # nn.LayerNorm's parameters at the same paths.
  assert jax.tree_util.tree_structure(fused_params) == jax.tree_util.tree_structure(params)
  relative = lambda a, b: max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda x, y: float(jnp.linalg.norm((x - y).ravel()) / jnp.linalg.norm(y.ravel())), a, b)))
  # Float32: the same function, its dropout masks drawn from the same keys.
  logits, grads = _logits_and_grads(SMALL, params, impl)
  fused_logits, fused_grads = _logits_and_grads(SMALL.replace(norm_implementation='pallas'),
                                                params, impl)
  np.testing.assert_allclose(fused_logits, logits, rtol=1e-5, atol=1e-5)
  assert relative(fused_grads, grads) < 1e-5
  # Bfloat16: the same logits (to the bit where interpreted), gradients as far from float32's as
  # XLA's are.
  half = SMALL.replace(dtype=jnp.bfloat16)
  half_logits, half_grads = _logits_and_grads(half, params, impl)
  fused_logits, fused_grads = _logits_and_grads(half.replace(norm_implementation='pallas'),
                                                params, impl)
  if INTERPRETED:
    np.testing.assert_array_equal(fused_logits, half_logits)
  np.testing.assert_allclose(fused_logits, half_logits, rtol=0,
                             atol=4 * _rounding(jnp.bfloat16) * np.abs(half_logits).max())
  assert relative(fused_grads, grads) < 1.1 * relative(half_grads, grads)
  # Evaluation computes XLA's layer norm either way.
  evaluate = lambda config: Transformer(config.replace(deterministic=True)).apply(
      {'params': params}, sources, sources)
  np.testing.assert_array_equal(evaluate(SMALL.replace(norm_implementation='pallas')),
                                evaluate(SMALL))
