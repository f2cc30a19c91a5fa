"""The model against the paper's section 3: shapes, sizes, masks, packing, cache, dropout, dtypes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default, wmt14
from transformer import plots
from transformer import config as config_lib
from transformer.model import (Transformer, TransformerConfig, dot_product_attention,
                               output_table, sinusoidal_encoding)

SMALL = TransformerConfig(vocab_size=23, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                          num_decoder_layers=2, max_positions=64)
VARIANTS = {
    'post-ln': SMALL,
    'pre-ln,learned,unshared': SMALL.replace(layer_norm='pre', positional_encoding='learned',
                                             share_embeddings=False, tie_output_embedding=False),
    'matrix projections': SMALL.replace(attention_projection='matrix'),  # a GPU's default
}


def random_tokens(seed, shape, vocab=SMALL.vocab_size):
  return jax.random.randint(jax.random.key(seed), shape, 1, vocab)


def init(cfg, sources, targets, seed=0):
  return Transformer(cfg).init(jax.random.key(seed), sources, targets)


def parameter_count(config: TransformerConfig) -> int:
  """Number of parameters, from shapes alone (nothing is allocated)."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
  return sum(x.size for x in jax.tree_util.tree_leaves(shapes['params']))


def expected_parameter_count(vocab, d, d_ff, encoder_layers, decoder_layers):
  """Counted from the paper's description: biases only in the feed-forward layers and LayerNorm."""
  attention = 4 * d * d  # W_Q, W_K, W_V (h heads of d/h) and W_O
  feed_forward = d * d_ff + d_ff + d_ff * d + d
  layer_norm = 2 * d
  encoder_layer = attention + feed_forward + 2 * layer_norm
  decoder_layer = 2 * attention + feed_forward + 3 * layer_norm
  return vocab * d + encoder_layers * encoder_layer + decoder_layers * decoder_layer


@pytest.mark.parametrize('config_arg,paper_millions,ours', [
    ('base,en-de', 65, 63_045_632),
    ('big,en-de', 213, 214_171_648),
])
def test_parameter_counts_match_the_paper(config_arg, paper_millions, ours):
  cfg = config_lib.model_config(wmt14.get_config(config_arg))
  count = parameter_count(cfg)
  assert count == ours == expected_parameter_count(37000, cfg.d_model, cfg.d_ff, 6, 6)
  # Table 3 rounds to millions and does not say how it counted; we are within 3.1%.
  assert abs(count / 1e6 - paper_millions) / paper_millions < 0.031


@pytest.mark.slow
def test_parameter_count_options():
  base = config_lib.model_config(default.get_config())
  shared = parameter_count(base)
  table = base.vocab_size * base.d_model
  assert parameter_count(base.replace(share_embeddings=False)) == shared + table
  assert parameter_count(base.replace(tie_output_embedding=False)) == shared + table
  assert parameter_count(base.replace(layer_norm='pre')) == shared + 2 * 2 * base.d_model
  assert (parameter_count(base.replace(positional_encoding='learned'))
          == shared + 2 * base.max_positions * base.d_model)


@pytest.mark.slow
def test_the_attention_core_is_flaxs_and_reads_a_decoding_cache_as_it_lies():
  # The one written-out attention (plain path, decoding cache, kernels' fallback): in float32 what
  # flax's nn.dot_product_attention computes, bit for bit, with dropout on the weights too; a cache
  # in its [batch, heads, depth, keys] / [batch, heads, keys, depth] layout gives the same output.
  query, key, value = (jax.random.normal(jax.random.key(i), shape) for i, shape in
                       enumerate([(2, 3, 4, 8), (2, 5, 4, 8), (2, 5, 4, 8)]))
  mask = jax.random.bernoulli(jax.random.key(3), 0.6, (2, 1, 3, 5)).at[:, :, 2].set(False)
  rng = jax.random.key(4)
  for dropout in ({}, dict(dropout_rng=rng, dropout_rate=0.3)):
    ours = dot_product_attention(query, key, value, mask, jnp.float32, **dropout)
    theirs = nn.dot_product_attention(query, key, value, mask=mask, deterministic=not dropout,
                                      **dropout)
    np.testing.assert_array_equal(ours, theirs)
  plain = dot_product_attention(query, key, value, mask, jnp.float32)
  cached = dot_product_attention(query, key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3),
                                 mask, jnp.float32, cache_layout=True)
  np.testing.assert_allclose(cached, plain, rtol=1e-6, atol=1e-6)
  # A query with nothing to attend to (row 2) averages the values evenly, as flax's does.
  np.testing.assert_allclose(plain[:, 2], value.mean(axis=1), rtol=1e-5, atol=1e-6)
  # In bfloat16 the weights multiply the values in bfloat16 (flax keeps them in float32).
  low = [x.astype(jnp.bfloat16) for x in (query, key, value)]
  np.testing.assert_allclose(dot_product_attention(*low, mask, jnp.bfloat16).astype(jnp.float32),
                             plain, atol=0.05)


def test_sinusoidal_encoding_is_the_papers_formula():
  pe = np.asarray(sinusoidal_encoding(jnp.arange(50), 16))
  pos, i = 37, 3
  np.testing.assert_allclose(pe[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 16)), rtol=1e-5)
  np.testing.assert_allclose(pe[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 16)), rtol=1e-5)


@pytest.mark.slow
def test_parameters_and_logits_dtypes_and_shapes():
  sources, targets = random_tokens(0, (3, 7)), random_tokens(1, (3, 5))
  cfg = SMALL.replace(dtype=jnp.bfloat16)
  variables = init(cfg, sources, targets)
  assert {x.dtype for x in jax.tree_util.tree_leaves(variables)} == {jnp.dtype('float32')}
  logits = Transformer(cfg).apply(variables, sources, targets)
  assert logits.shape == (3, 5, SMALL.vocab_size) and logits.dtype == jnp.float32


@pytest.mark.slow
@pytest.mark.parametrize('name', VARIANTS)
def test_decoder_is_causal(name):
  cfg = VARIANTS[name]
  sources, targets = random_tokens(0, (2, 6)), random_tokens(1, (2, 8))
  model, variables = Transformer(cfg), init(cfg, sources, targets)
  logits = model.apply(variables, sources, targets)
  for t in range(targets.shape[1] - 1):
    changed = targets.at[:, t + 1:].set(random_tokens(t + 2, (2, targets.shape[1] - t - 1)))
    assert (changed != targets).any()
    new_logits = model.apply(variables, sources, changed)
    # Position p predicts target p from targets < p, so positions up to t + 1 cannot change ...
    np.testing.assert_allclose(new_logits[:, :t + 2], logits[:, :t + 2], atol=1e-6)
    # ... and later ones do.
    if t + 2 < targets.shape[1]:
      assert np.abs(new_logits[:, t + 2:] - logits[:, t + 2:]).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize('name', VARIANTS)
def test_padding_leaves_real_positions_unchanged(name):
  cfg = VARIANTS[name]
  # Rows of different lengths: row 1 is shorter and already padded.
  sources = random_tokens(0, (2, 6)).at[1, 4:].set(0)
  targets = random_tokens(1, (2, 5)).at[1, 3:].set(0)
  model, variables = Transformer(cfg), init(cfg, sources, targets)
  logits = model.apply(variables, sources, targets)
  padded = model.apply(variables, jnp.pad(sources, ((0, 0), (0, 5))),
                       jnp.pad(targets, ((0, 0), (0, 4))))
  real = np.asarray(targets > 0)
  np.testing.assert_allclose(padded[:, :5][real], logits[real], atol=1e-5)
  # The short row alone, without the padding its batch gave it.
  alone = model.apply(variables, sources[1:, :4], targets[1:, :3])
  np.testing.assert_allclose(logits[1, :3], alone[0], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('name', VARIANTS)
def test_packed_pairs_equal_separate_pairs(name):
  cfg = VARIANTS[name]
  s1, t1 = random_tokens(0, (1, 4)), random_tokens(1, (1, 3))
  s2, t2 = random_tokens(2, (1, 3)), random_tokens(3, (1, 5))
  model, variables = Transformer(cfg), init(cfg, s1, t1)

  def pack(a, b, length):
    pad = length - a.shape[1] - b.shape[1]
    tokens = jnp.concatenate([a, b, jnp.zeros((1, pad), jnp.int32)], axis=1)
    segments = jnp.array([[1] * a.shape[1] + [2] * b.shape[1] + [0] * pad])
    positions = jnp.array([list(range(a.shape[1])) + list(range(b.shape[1])) + [0] * pad])
    return tokens, segments, positions

  sources, source_segments, source_positions = pack(s1, s2, 9)
  targets, target_segments, target_positions = pack(t1, t2, 10)
  packed = model.apply(variables, sources, targets, source_positions, source_segments,
                       target_positions, target_segments)
  np.testing.assert_allclose(packed[0, :3], model.apply(variables, s1, t1)[0], atol=1e-5)
  np.testing.assert_allclose(packed[0, 3:8], model.apply(variables, s2, t2)[0], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('name', VARIANTS)
def test_sown_attention_weights_are_the_softmax_each_layer_used(name):
  cfg = VARIANTS[name]
  # Row 0 packs two pairs (segments 1 and 2); row 1 is one pair and padding.
  source_segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
  target_segments = np.array([[1, 1, 1, 1, 2, 2, 0], [1, 1, 1, 0, 0, 0, 0]])
  restart = lambda segments: np.array([[sum(s == x for x in row[:i]) for i, s in enumerate(row)]
                                       for row in segments])
  sources = random_tokens(0, source_segments.shape) * (source_segments > 0)
  targets = random_tokens(1, target_segments.shape) * (target_segments > 0)
  packing = dict(source_positions=restart(source_segments), source_segment_ids=source_segments,
                 target_positions=restart(target_segments), target_segment_ids=target_segments)
  variables = init(cfg, sources, targets)
  weights, logits = plots.attention_weights(cfg, variables['params'], sources, targets,
                                                **packing)
  # Collecting them changes nothing the model computes.
  assert np.array_equal(logits, Transformer(cfg).apply(variables, sources, targets, **packing))

  same = lambda q, k: (q[:, :, None] == k[:, None, :]) & (q[:, :, None] > 0)
  causal = np.tril(np.ones((target_segments.shape[1],) * 2, bool))
  allowed = {'encoder_self_attention': same(source_segments, source_segments),
             'decoder_self_attention': same(target_segments, target_segments) & causal,
             'cross_attention': same(target_segments, source_segments)}
  for name_, w in weights.items():
    layers = cfg.num_encoder_layers if name_.startswith('encoder') else cfg.num_decoder_layers
    assert w.shape[:3] == (2, layers, cfg.num_heads)
    mask = np.broadcast_to(allowed[name_][:, None, None], w.shape)
    real_queries = mask.any(-1)
    # Each real query's weights are a distribution over the keys it may see, and only those.
    np.testing.assert_allclose(w.sum(-1)[real_queries], 1.0, atol=1e-6)
    assert (w[~mask & real_queries[..., None]] == 0).all()

  # Encoder layer 1's weights, computed by hand from its input and projections.
  params = variables['params']
  table = params['source_embedding']['embedding']
  x = table[sources] * np.sqrt(cfg.d_model)
  if cfg.positional_encoding == 'learned':
    x = x + params['encoder']['embedder']['position_embedding'][packing['source_positions']]
  else:
    x = x + sinusoidal_encoding(packing['source_positions'], cfg.d_model)
  layer = params['encoder']['layer_0']
  if cfg.layer_norm == 'pre':
    norm = layer['self_attention_residual']['norm']
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    x = (x - mean) / np.sqrt(var + cfg.layer_norm_epsilon) * norm['scale'] + norm['bias']
  kernels = layer['self_attention']
  query = np.einsum('bld,dhk->bhlk', x, kernels['query']['kernel'])
  key = np.einsum('bld,dhk->bhlk', x, kernels['key']['kernel'])
  scores = np.einsum('bhqk,bhlk->bhql', query, key) / np.sqrt(cfg.d_model // cfg.num_heads)
  scores = np.where(allowed['encoder_self_attention'][:, None], scores, -1e30)
  expected = np.exp(scores - scores.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  rows = allowed['encoder_self_attention'].any(-1)  # real source positions
  np.testing.assert_allclose(weights['encoder_self_attention'][:, 0].transpose(0, 2, 1, 3)[rows],
                             expected.transpose(0, 2, 1, 3)[rows], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('name', VARIANTS)
def test_cached_decoding_equals_full_forward(name):
  cfg = VARIANTS[name]
  sources = random_tokens(0, (3, 7)).at[2, 5:].set(0)
  targets = random_tokens(1, (3, 6))
  model, variables = Transformer(cfg), init(cfg, sources, targets)
  full = model.apply(variables, sources, targets)

  decoder = Transformer(cfg.replace(decode=True))
  encoded = model.apply(variables, sources, method=Transformer.encode)
  _, state = decoder.apply(variables, encoded, sources, jnp.zeros_like(targets),
                           method=Transformer.decode, mutable=['cache'])
  step = jax.jit(lambda cache, token: decoder.apply(
      {**variables, 'cache': cache}, encoded, sources, token, method=Transformer.decode,
      mutable=['cache']))
  cache, token, steps = state['cache'], jnp.zeros((3, 1), jnp.int32), []
  for t in range(targets.shape[1]):
    logits, state = step(cache, token)
    cache, token = state['cache'], targets[:, t:t + 1]
    steps.append(logits[:, 0])
  assert np.abs(np.stack(steps, axis=1) - full).max() <= 1e-5


@pytest.mark.slow
def test_each_dropout_rate_is_applied_only_when_training():
  sources, targets = random_tokens(0, (2, 6)), random_tokens(1, (2, 5))
  variables = init(SMALL, sources, targets)
  reference = Transformer(SMALL).apply(variables, sources, targets)
  no_dropout = SMALL.replace(dropout_rate=0.0, deterministic=False)
  rngs = {'dropout': jax.random.key(7)}
  np.testing.assert_array_equal(Transformer(no_dropout).apply(variables, sources, targets,
                                                              rngs=rngs), reference)
  for rate in ('dropout_rate', 'attention_dropout_rate', 'relu_dropout_rate'):
    cfg = no_dropout.replace(**{rate: 0.3})
    out = Transformer(cfg).apply(variables, sources, targets, rngs=rngs)
    assert np.abs(out - reference).max() > 1e-2, rate
    other_rng = Transformer(cfg).apply(variables, sources, targets,
                                       rngs={'dropout': jax.random.key(8)})
    assert np.abs(out - other_rng).max() > 1e-2, rate
    evaluation = Transformer(cfg.replace(deterministic=True)).apply(variables, sources, targets)
    np.testing.assert_array_equal(evaluation, reference)


@pytest.mark.slow
def test_bfloat16_compute_stays_close_to_float32():
  cfg = SMALL.replace(d_model=64, d_ff=256)
  sources, targets = random_tokens(0, (4, 12), cfg.vocab_size), random_tokens(1, (4, 10))
  variables = init(cfg, sources, targets)
  full = Transformer(cfg).apply(variables, sources, targets)
  half = Transformer(cfg.replace(dtype=jnp.bfloat16)).apply(variables, sources, targets)
  # bfloat16 keeps 8 significant bits (relative step 2^-8 = 0.4%); two layers stay within 0.1 nat.
  p_full, p_half = jax.nn.log_softmax(full), jax.nn.log_softmax(half)
  assert np.abs(p_full - p_half).max() < 0.1
  assert (np.argmax(full, -1) == np.argmax(half, -1)).mean() > 0.9


@pytest.mark.slow
@pytest.mark.parametrize('tie_output_embedding', [True, False])
def test_bfloat16_models_project_to_unrounded_float32_logits(tie_output_embedding):
  # bfloat16 logits would be off by up to 2^-9 of their size: beam scores and the loss rounded.
  # The operands are bfloat16 (the table rounded to it), their products summed in float32.
  cfg = SMALL.replace(dtype=jnp.bfloat16, tie_output_embedding=tie_output_embedding)
  sources, targets = random_tokens(0, (4, 12), cfg.vocab_size), random_tokens(1, (4, 10))
  params = init(cfg, sources, targets)['params']
  logits = Transformer(cfg).apply({'params': params}, sources, targets)
  states = Transformer(cfg).apply({'params': params}, sources, targets, project=False)
  assert states.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
  table = np.asarray(output_table(params).astype(jnp.bfloat16), np.float64)
  want = np.asarray(states, np.float64) @ table.T
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  rounded = np.asarray(want.astype(jnp.bfloat16), np.float64)
  assert np.abs(logits - rounded).max() > 1e-4  # not bfloat16 logits


@pytest.mark.slow
def test_a_bfloat16_model_projects_float32_states_with_a_float32_table_when_told():
  # output_projection_dtype='float32': the decoder's output cast to float32 and multiplied by the
  # unrounded table, as flax's examples/wmt projects; by default the table rounded to bfloat16.
  cfg = SMALL.replace(dtype=jnp.bfloat16, output_projection_dtype=jnp.float32)
  sources, targets = random_tokens(0, (4, 12), cfg.vocab_size), random_tokens(1, (4, 10))
  params = init(cfg, sources, targets)['params']
  logits = Transformer(cfg).apply({'params': params}, sources, targets)
  states = Transformer(cfg).apply({'params': params}, sources, targets, project=False)
  assert states.dtype == jnp.float32
  bfloat16_states = Transformer(cfg.replace(output_projection_dtype=None)).apply(
      {'params': params}, sources, targets, project=False)
  np.testing.assert_array_equal(states, bfloat16_states.astype(jnp.float32))
  table = np.asarray(output_table(params), np.float64)
  np.testing.assert_allclose(logits, np.asarray(states, np.float64) @ table.T, rtol=1e-5,
                             atol=1e-6)
  rounded_table = np.asarray(output_table(params).astype(jnp.bfloat16), np.float64)
  assert np.abs(logits - np.asarray(states, np.float64) @ rounded_table.T).max() > 1e-4


@pytest.mark.slow
def test_bfloat16_models_sum_embedding_gradients_in_float32():
  # 4096 lookups of one token: their gradient rows summed in bfloat16 drift by several percent,
  # while each row is rounded to bfloat16 alone (2^-9) when the sum is in float32.
  cfg = SMALL.replace(dtype=jnp.bfloat16, num_encoder_layers=0, num_decoder_layers=0)
  sources = jnp.full((8, 512), 5, jnp.int32)
  model = Transformer(cfg)
  params = init(cfg, sources[:1, :2], sources[:1, :2])['params']
  weights = jax.random.normal(jax.random.key(1), (*sources.shape, cfg.d_model))

  def weighted_sum(params):  # d/d(row 5) = sqrt(d_model) * the sum of the weights
    encoded = model.apply({'params': params}, sources, method=Transformer.encode)
    return (encoded.astype(jnp.float32) * weights).sum()

  grad = jax.grad(weighted_sum)(params)['source_embedding']['embedding']
  want = np.sqrt(cfg.d_model) * np.asarray(weights, np.float64).sum((0, 1))
  assert grad.dtype == jnp.float32
  assert np.linalg.norm(grad[5] - want) / np.linalg.norm(want) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize('layer_norm', ['post', 'pre'])
def test_training_on_a_copy_task_lowers_the_loss(layer_norm):
  cfg = SMALL.replace(layer_norm=layer_norm, dropout_rate=0.1, deterministic=False)
  model = Transformer(cfg)
  data = random_tokens(0, (64, 8))
  params = init(cfg, data, data)['params']
  optimizer = optax.adam(5e-3, b1=0.9, b2=0.98, eps=1e-9)

  def loss_fn(params, batch, rng):
    logits = model.apply({'params': params}, batch, batch, rngs={'dropout': rng})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch).mean()

  @jax.jit
  def train_step(params, opt_state, batch, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = optimizer.init(params), []
  for step in range(100):
    batch = data[(step % 2) * 32:(step % 2 + 1) * 32]
    params, opt_state, loss = train_step(params, opt_state, batch, jax.random.key(step))
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
