"""The model with each faster implementation (transformer/kernels) computes what it computes with
the plain forms: the fused attention, the projections as matrices, the ReLU, the dropout, the
blocked top-k."""

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import decode, kernels
from transformer.kernels import attention as kernel_attention
from transformer.kernels import hash_rng
from transformer.kernels.choice import Machine
from transformer.model import Dropout, Transformer, TransformerConfig

SMALL = TransformerConfig(vocab_size=23, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                          num_decoder_layers=2, max_positions=64)


def random_tokens(seed, shape, vocab=SMALL.vocab_size):
  return jax.random.randint(jax.random.key(seed), shape, 1, vocab)


def init(cfg, sources, targets, seed=0):
  return Transformer(cfg).init(jax.random.key(seed), sources, targets)


@pytest.mark.slow
@pytest.mark.parametrize('implementation,dtype,tolerance', [
    pytest.param('cudnn', jnp.bfloat16, (0.05, 0.03), marks=pytest.mark.skipif(
        not Machine.here().runs_fused_kernels,
        reason='cuDNN attention runs only on an NVIDIA GPU from Ampere on (here: '
               f'{Machine.here()})')),
    # In float32 (Pallas's interpreter off a GPU): the model's other roundings do not hide a
    # difference in the kernels' (bfloat16: tests/kernels/test_pallas_attention.py).
    ('pallas', jnp.float32, (1e-5, 1e-4))])
def test_fused_attention_computes_what_xla_attention_does(implementation, dtype, tolerance,
                                                          request):
  if dtype == jnp.float32:  # bfloat16's keep the default, as when cuDNN's case passed on an H100
    request.getfixturevalue('float32_matmuls')
  # A packed row (two pairs, then padding) and a padded row, through the encoder's attention, the
  # decoder's causal self-attention and its cross-attention: the masks the kernels get.
  cfg = SMALL.replace(d_model=128, num_heads=2, dtype=dtype, deterministic=True)
  sources = jnp.array([[5, 6, 7, 8, 9, 10, 0, 0], [3, 4, 5, 0, 0, 0, 0, 0]])
  source_segments = jnp.array([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
  source_positions = jnp.array([[0, 1, 2, 0, 1, 2, 0, 0], [0, 1, 2, 0, 0, 0, 0, 0]])
  targets = jnp.array([[11, 12, 13, 14, 15, 0], [7, 8, 9, 10, 0, 0]])
  target_segments = jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
  target_positions = jnp.array([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]])
  batch = (sources, targets, source_positions, source_segments, target_positions,
           target_segments)
  params = init(cfg, sources, targets)['params']
  real = (targets > 0)[..., None]

  def loss_and_logits(params, implementation):
    logits = Transformer(cfg.replace(attention_implementation=implementation)).apply(
        {'params': params}, *batch)
    return (jax.nn.log_softmax(logits) * real).sum() / 100, logits

  grad_fn = jax.jit(jax.grad(loss_and_logits, has_aux=True), static_argnums=1)
  (xla_grads, xla_logits), (fused_grads, fused_logits) = (
      grad_fn(params, name) for name in ('xla', implementation))
  difference = np.abs(np.asarray(fused_logits - xla_logits) * np.asarray(real)).max()
  assert difference < tolerance[0] * np.abs(np.asarray(xla_logits) * np.asarray(real)).max()
  for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(xla_grads),
                              jax.tree_util.tree_leaves(fused_grads)):
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) <= tolerance[1] * np.linalg.norm(want) + 1e-6, path


@pytest.mark.slow
def test_attention_projections_as_matrices_compute_what_the_head_axes_do():
  # attention_projection='matrix' multiplies by the kernels as matrices ([..., d_model] by
  # [d_model, heads * depth], [..., heads * depth] by [heads * depth, d_model]): the same
  # parameters (a checkpoint of either reads in the other), the same loss and gradients.
  sources, targets = random_tokens(0, (3, 7)), random_tokens(1, (3, 6))
  matrix = SMALL.replace(attention_projection='matrix')
  params = init(matrix, sources, targets)['params']
  assert (jax.tree_util.tree_map(jnp.shape, params) ==
          jax.tree_util.tree_map(jnp.shape, init(SMALL, sources, targets)['params']))

  def loss(params, cfg):
    logits = Transformer(cfg).apply({'params': params}, sources, targets)
    return jnp.sum(jax.nn.log_softmax(logits) ** 2)

  theirs, ours = (jax.value_and_grad(loss)(params, cfg) for cfg in (SMALL, matrix))
  for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(theirs),
                              jax.tree_util.tree_leaves(ours)):  # float32 sums, in other orders
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), path


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_relu_and_its_gradient_are_jaxs(dtype):
  # The feed-forward ReLU takes its derivative from its output (so XLA can fuse it into the
  # matmul): values and gradients exactly jax.nn.relu's, at 0 and -0 too (gradient 0 there).
  x = jnp.concatenate([jnp.array([0.0, -0.0, 1e-30, -1e-30]),
                       jax.random.normal(jax.random.key(0), (1000,))]).astype(dtype)
  weights = jax.random.normal(jax.random.key(1), x.shape).astype(dtype)
  ours, theirs = (jax.value_and_grad(lambda x, f=f: jnp.sum(f(x) * weights))(x)
                  for f in (kernels.relu, jax.nn.relu))
  np.testing.assert_array_equal(kernels.relu(x), jax.nn.relu(x))
  np.testing.assert_array_equal(ours[1], theirs[1])
  assert ours[1][0] == ours[1][1] == ours[1][3] == 0 and ours[1][2] == weights[2]


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('impl', [hash_rng.IMPL, 'threefry2x32'])
def test_dropout_and_its_gradient_are_flaxs_with_the_mask_drawn_again(dtype, impl, capsys):
  x = jax.random.normal(jax.random.key(0), (64, 32)).astype(dtype)
  weights = jax.random.normal(jax.random.key(1), x.shape).astype(dtype)
  rngs = {'dropout': jax.random.key(3, impl=impl)}
  loss = lambda module: lambda x: jnp.sum(
      module.apply({}, x, deterministic=False, rngs=rngs) * weights)
  ours, theirs = (jax.value_and_grad(loss(module(0.3)))(x) for module in (Dropout, nn.Dropout))
  np.testing.assert_array_equal(Dropout(0.3).apply({}, x, deterministic=False, rngs=rngs),
                                nn.Dropout(0.3).apply({}, x, deterministic=False, rngs=rngs))
  np.testing.assert_allclose(ours[0], theirs[0], atol=1e-4)  # the same terms, another order
  np.testing.assert_array_equal(ours[1], theirs[1])
  assert 0.25 < np.mean(ours[1] == 0) < 0.35
  # What the backward pass keeps from the forward: flax's dropout a boolean mask, ours with a
  # 'hash' key two words to draw it again from.
  for module, kept in ((nn.Dropout, True), (Dropout, impl != hash_rng.IMPL)):
    jax.ad_checkpoint.print_saved_residuals(loss(module(0.3)), x)
    assert ('bool[64,32]' in capsys.readouterr().out) == kept


@pytest.mark.parametrize('rows,n,k,block', [(3, 5000, 8, 128), (4, 4 * 16000, 8, 128),
                                            (2, 37, 3, 4), (5, 300, 2, 16)])
def test_top_k_by_blocks_is_lax_top_k_ties_included(rows, n, k, block):
  rng = np.random.default_rng(n)
  few_values = rng.integers(0, 7, (rows, n)).astype(np.float32)  # ties everywhere
  spread = rng.normal(size=(rows, n)).astype(np.float32)
  spread[0, ::3] = decode.NEG_INF  # as empty beams give
  # A few larger values in the last blocks rank those first; the rest of the k tie at 6.
  ranked_late = few_values.copy()
  ranked_late[:, -k // 2:] = 100 + np.arange(k // 2)
  for x in (few_values, ranked_late, spread, -np.abs(spread)):
    values, indices = jax.jit(kernels.top_k, static_argnums=(1, 2))(x, k, block)
    want_values, want_indices = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(indices, want_indices)


@pytest.mark.parametrize('beam,vocab,k', [(4, 16000, 8), (3, 37, 6), (64, 4, 128)])
def test_best_continuations_are_top_k_over_every_normalized_candidate(beam, vocab, k):
  batch, rng = 5, np.random.default_rng(vocab)
  logits = rng.normal(size=(batch * beam, vocab)).astype(np.float32) * 4
  logits[:beam] = logits[0]  # a first step: every beam the same row, all but one empty
  live = rng.normal(size=(batch, beam)).astype(np.float32) - 10
  live[0, 1:] = decode.NEG_INF
  at_limit = np.array([False, True, False, True, False])[:, None, None]
  allowed = decode.allowed(np.arange(vocab), at_limit)
  best, beams, tokens = jax.jit(kernels.best_continuations, static_argnums=(3, 4))(
      logits, live, allowed, k, decode.NEG_INF)

  log_probs = jax.nn.log_softmax(logits).reshape(batch, beam, vocab)
  candidates = live[:, :, None] + np.where(allowed, log_probs, decode.NEG_INF)
  want_best, want_ids = jax.lax.top_k(candidates.reshape(batch, -1), k)
  np.testing.assert_array_equal(beams, want_ids // vocab)
  np.testing.assert_array_equal(tokens, want_ids % vocab)
  np.testing.assert_allclose(best, want_best, rtol=1e-6)
  # At the limit only EOS, once per live beam, then disallowed tokens at live + NEG_INF.
  assert (np.asarray(tokens[1, :beam]) == decode.EOS_ID).all()
  assert (np.asarray(best[1, beam:]) < decode.NEG_INF / 2).all()


@pytest.mark.slow
def test_a_kernel_replacing_the_plain_attention_says_so_once(monkeypatch):
  # Logged when traced: once that the Pallas kernels replace model.dot_product_attention, once
  # that rows longer than they take run the plain form, whatever the layers and calls.
  messages = []
  monkeypatch.setattr(kernel_attention.logging, 'info',
                      lambda message, *args: messages.append(message % args))
  monkeypatch.setattr(kernel_attention, '_logged', set())
  cfg = SMALL.replace(d_model=32, num_heads=2, attention_implementation='pallas')
  for length in (8, 8, 130):
    sources, targets = random_tokens(0, (2, length)), random_tokens(1, (2, length))
    Transformer(cfg).init(jax.random.key(0), sources, targets)
  assert messages == [
      'attention: the pallas kernels replace model.dot_product_attention',
      'attention: model.dot_product_attention for lengths the pallas kernels do not take '
      '(130 queries, 130 keys)']
  assert not kernel_attention.applies(cfg.replace(decode=True), 8, 8)
  assert not kernel_attention.applies(cfg.replace(attention_implementation='xla'), 8, 8)
