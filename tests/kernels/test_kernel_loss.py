"""The loss's sums from the decoder's output (transformer/kernels/loss.py): in one read of the
logits, or a chunk at a time, they are `loss.token_sums` of the full logits, gradients included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import loss
from transformer.kernels import loss as kernel_loss
from transformer.model import Transformer, TransformerConfig, output_table, project

pytestmark = pytest.mark.usefixtures('float32_matmuls')


@pytest.mark.slow
@pytest.mark.parametrize('scale', [1.0, 30.0])  # 30: exp(logit) overflows float32 unshifted
def test_online_sums_equal_the_separate_passes_with_their_gradients(scale):
  """One variadic pass gives `token_sums`'s values, and its written-out gradient autodiff's, for
  every sum and any scale on it; ties and a row of equal logits included."""
  key_logits, key_targets, key_scales = jax.random.split(jax.random.key(3), 3)
  logits = scale * jax.random.normal(key_logits, (5, 37, 301))
  logits = logits.at[0, 0].set(2.0).at[0, 1, :7].set(logits[0, 1].max())  # a flat row, a tie
  targets = jax.random.randint(key_targets, (5, 37), 0, 301).at[0, 1].set(3)
  for label_smoothing in (0.0, 0.1):
    want = loss.token_sums(logits, targets, label_smoothing)
    got = jax.jit(kernel_loss.online_token_sums, static_argnums=2)(logits, targets, label_smoothing)
    for name in kernel_loss.SUMS:
      np.testing.assert_allclose(got[name], want[name], rtol=2e-6, err_msg=name)
    assert float(got['correct']) > 0 and float(got['tokens']) < targets.size
    cotangents = dict(zip(kernel_loss.SUMS, jax.random.normal(key_scales, (4,))))
    weighted = lambda sums_of: jax.grad(lambda l: sum(
        cotangents[name] * value for name, value in sums_of(l, targets, label_smoothing).items()))
    want_grad = weighted(loss.token_sums)(logits)
    got_grad = jax.jit(weighted(kernel_loss.online_token_sums))(logits)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert not np.any(got_grad[targets == 0])


def _problem(rows=6, length=20, width=16, vocab=50, real=None):
  """Decoder states, an output table and targets whose rows end in padding."""
  states = jax.random.normal(jax.random.key(1), (rows, length, width))
  table = jax.random.normal(jax.random.key(2), (vocab, width))
  rng = np.random.default_rng(0)
  targets = rng.integers(1, vocab, (rows, length))
  lengths = rng.integers(1, length + 1, rows) if real is None else np.full(rows, real)
  targets[np.arange(length) >= lengths[:, None]] = 0
  return states, table, jnp.asarray(targets, jnp.int32)


def _sums_and_grads(sums_fn, states, table):
  def loss_sum(states, table):
    sums = sums_fn(states, table)
    return sums['loss'], sums
  (_, sums), grads = jax.jit(jax.value_and_grad(loss_sum, argnums=(0, 1), has_aux=True))(
      states, table)
  return sums, grads


@pytest.mark.slow
@pytest.mark.parametrize('reduction,chunk', [
    (reduction, chunk) for reduction in ('separate', 'online')
    for chunk in (1, 7, 32, 120, 1000, None)])  # None: all at once
@pytest.mark.parametrize('real', [None, 0, 20])  # ragged rows, all padding, no padding
@pytest.mark.parametrize('label_smoothing', [0.0, 0.1])
def test_chunked_projection_gives_the_full_logits_sums_and_gradients(chunk, real,
                                                                    label_smoothing, reduction):
  states, table, targets = _problem(real=real)
  full = lambda s, t: loss.token_sums(project(s, t), targets, label_smoothing)
  chunked = lambda s, t: kernel_loss.projected_token_sums(s, t, targets, label_smoothing, chunk,
                                                   reduction)
  (want, want_grads), (got, got_grads) = (_sums_and_grads(f, states, table)
                                          for f in (full, chunked))
  for name in kernel_loss.SUMS:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
  for got_grad, want_grad in zip(got_grads, want_grads):
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-6)
  if real == 0:
    assert float(got['tokens']) == 0 and not np.any(got_grads[0]) and not np.any(got_grads[1])


@pytest.mark.slow
@pytest.mark.parametrize('reduction,chunk', [('separate', 16), ('online', None)])
def test_chunked_sums_without_gradients_and_under_a_scaled_loss(reduction, chunk):
  """The forward-only path (evaluation) and a loss scaled after the sums (normalisation)."""
  states, table, targets = _problem()
  want = loss.token_sums(project(states, table), targets, 0.1)
  sums_of = lambda s, t: kernel_loss.projected_token_sums(s, t, targets, 0.1, chunk, reduction)
  got = jax.jit(sums_of)(states, table)
  for name in kernel_loss.SUMS:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
  scaled = lambda fn: jax.grad(lambda s: 3.0 * fn(s)['loss'] / fn(s)['tokens'])(states)
  np.testing.assert_allclose(
      scaled(lambda s: kernel_loss.projected_token_sums(s, table, targets, 0.1, chunk, reduction)),
      scaled(lambda s: loss.token_sums(project(s, table), targets, 0.1)),
      rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize('reduction,chunk', [('separate', 16), ('online', None)])
def test_only_the_loss_carries_a_gradient(reduction, chunk):
  states, table, targets = _problem()
  for name in ('nll', 'correct', 'tokens'):
    grad = jax.grad(lambda s: kernel_loss.projected_token_sums(s, table, targets, 0.1, chunk,
                                                        reduction)[name])(states)
    assert not np.any(grad), name


@pytest.mark.slow
@pytest.mark.parametrize('variant', [
    {}, {'share_embeddings': False}, {'tie_output_embedding': False}, {'dtype': jnp.bfloat16}])
def test_projection_of_the_decoder_output_is_the_models_logits(variant):
  """`project(states, output_table(params))` is what the model's output projection computes, and
  the chunked sums of the decoder output are the sums of the model's logits."""
  cfg = TransformerConfig(vocab_size=40, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
                          num_decoder_layers=1, **variant)
  _, _, targets = _problem(rows=3, length=9, vocab=40)
  sources = jnp.flip(targets, axis=1) + (targets > 0)
  model = Transformer(cfg)
  params = model.init(jax.random.key(0), sources, targets)['params']
  logits = model.apply({'params': params}, sources, targets)
  states = model.apply({'params': params}, sources, targets, project=False)
  assert states.shape == (3, 9, 16) and logits.dtype == jnp.float32
  np.testing.assert_array_equal(project(states, output_table(params)), logits)
  want = loss.token_sums(logits, targets, 0.1)
  got = kernel_loss.projected_token_sums(states, output_table(params), targets, 0.1, 8)
  for name in kernel_loss.SUMS:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5)


@pytest.mark.parametrize('reduction', ['separate', 'online'])
def test_bfloat16_projection_gradients_are_float32_products_of_bfloat16_operands(reduction):
  """The backward products run on bfloat16 operands (the logits' gradient rounded to bfloat16)
  with float32 sums: within bfloat16 rounding of the float32 gradients, the table's kept float32."""
  states, table, targets = _problem()
  half = states.astype(jnp.bfloat16)
  sums_of = lambda s, t: loss.token_sums(project(s, t), targets, 0.1)['loss']
  tested = lambda s, t: kernel_loss.projected_token_sums(s, t, targets, 0.1, None,
                                                        reduction)['loss']
  states_grad, table_grad = jax.jit(jax.grad(tested, argnums=(0, 1)))(half, table)
  assert states_grad.dtype == jnp.bfloat16 and table_grad.dtype == jnp.float32
  rounded = table.astype(jnp.bfloat16).astype(jnp.float32)
  want_states, want_table = jax.grad(sums_of, argnums=(0, 1))(half.astype(jnp.float32), rounded)
  relative = lambda got, want: float(jnp.linalg.norm(got.astype(jnp.float32) - want) /
                                     jnp.linalg.norm(want))
  assert 1e-5 < relative(states_grad, want_states) < 1e-2
  assert 1e-6 < relative(table_grad, want_table) < 1e-2
