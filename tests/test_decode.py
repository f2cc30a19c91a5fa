"""Greedy and beam search against brute force, uncached decoding and the paper's rules."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import decode, sampling
from transformer.model import Transformer, TransformerConfig

# Vocabulary of 4: pad 0, EOS 1 and two words. Scaled weights make the distributions peaked.
CONFIG = TransformerConfig(vocab_size=4, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
                           num_decoder_layers=1)
SOURCES = jnp.array([[2, 3, 2, 1], [3, 1, 0, 0], [2, 2, 3, 1]])


@pytest.fixture(scope='module', params=[3, 4])
def params(request):
  params = Transformer(CONFIG).init(jax.random.key(request.param), SOURCES, SOURCES)['params']
  return jax.tree_util.tree_map(lambda x: 4 * x, params)


def sequence_log_probs(params, source, sequences):
  """log P(sequence | source) for each sequence, from one full forward pass (no cache)."""
  length = max(map(len, sequences))
  targets = jnp.array([seq + [0] * (length - len(seq)) for seq in sequences])
  logits = Transformer(CONFIG).apply({'params': params}, jnp.tile(source, (len(sequences), 1)),
                                     targets)
  token_log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
  return np.asarray((token_log_probs[..., 0] * (targets > 0)).sum(-1))


def brute_force_best(params, source, extra_length, alpha):
  """Highest log P / length penalty over every sequence up to the length limit (EOS last)."""
  limit = int((source > 0).sum()) + extra_length
  sequences = [list(body) + [decode.EOS_ID] for length in range(limit)
               for body in itertools.product([2, 3], repeat=length)]  # pad is never an output
  scores = sequence_log_probs(params, source, sequences) / np.array(
      [float(decode.length_penalty(len(seq), alpha)) for seq in sequences])
  best = int(np.argmax(scores))
  return float(scores[best]), sequences[best]


def strip(row):
  row = list(np.asarray(row))
  return row[:row.index(decode.EOS_ID) + 1]


def always_predicting(token: int):
  """Parameters giving `token` the logit 16, EOS -16 (unless it is `token`), others 0."""
  config = CONFIG.replace(tie_output_embedding=False)
  params = Transformer(config).init(jax.random.key(0), SOURCES, SOURCES)['params']
  table = jnp.zeros((4, 16)).at[decode.EOS_ID].set(-1.0).at[token].set(1.0)  # [vocab, d_model]
  params['output_projection']['embedding'] = table
  # The last LayerNorm's output then sums to 16, so row c of the table gives 16 * c.
  last_norm = params['decoder']['layer_0']['feed_forward_residual']['norm']
  last_norm['bias'] = jnp.ones(16)
  return config, params


@pytest.mark.slow
def test_beam_size_one_is_greedy_search(params):
  greedy = sampling.greedy_search(CONFIG, params, SOURCES, extra_length=3)
  beam, _, _ = decode.beam_search(CONFIG, params, SOURCES, beam_size=1, extra_length=3)
  np.testing.assert_array_equal(greedy, beam[:, 0])


def test_cached_greedy_equals_recomputing_the_prefix(params):
  greedy = sampling.greedy_search(CONFIG, params, SOURCES, extra_length=3)
  forward = jax.jit(Transformer(CONFIG).apply)
  for row, source in enumerate(SOURCES):
    limit = int((source > 0).sum()) + 3
    tokens = []
    while not tokens or tokens[-1] != decode.EOS_ID:
      # The whole prefix again; later positions hold placeholders, which causality ignores.
      targets = jnp.array([tokens + [2] * (greedy.shape[1] - len(tokens))])
      logits = forward({'params': params}, source[None], targets)
      next_logits = np.array(logits[0, len(tokens)])
      next_logits[decode.PAD_ID] = -np.inf
      if len(tokens) + 1 == limit:
        next_logits[np.arange(4) != decode.EOS_ID] = -np.inf
      tokens.append(int(next_logits.argmax()))
    assert strip(greedy[row]) == tokens


@pytest.mark.slow
@pytest.mark.parametrize('cache_stage', [2, decode.CACHE_STAGE])
def test_cached_beam_search_equals_recomputing_the_prefix(params, cache_stage):
  tokens, scores, _ = decode.beam_search(CONFIG, params, SOURCES, beam_size=4, alpha=0.6,
                                         extra_length=3, cache_stage=cache_stage)
  for row, source in enumerate(SOURCES):
    hypothesis = strip(tokens[row, 0])
    expected = sequence_log_probs(params, source, [hypothesis])[0] / float(
        decode.length_penalty(len(hypothesis), 0.6))
    assert float(scores[row, 0]) == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_a_cache_grown_in_stages_gives_the_same_search():
  # Limits of 7-9 positions: stages of 1 and 3 grow the cache 8 and 2 times, 64 never.
  config, params = always_predicting(2)
  params['output_projection']['embedding'] += jax.random.normal(jax.random.key(1), (4, 16))
  results = [decode.beam_search(config, params, SOURCES, beam_size=2, extra_length=5,
                                cache_stage=stage) for stage in (1, 3, 64)]
  for tokens, scores, steps in results[:2]:
    np.testing.assert_array_equal(tokens, results[-1][0])
    np.testing.assert_allclose(scores, results[-1][1], rtol=1e-6)
    assert int(steps) == int(results[-1][2])


@pytest.mark.slow
@pytest.mark.parametrize('alpha', [0.0, 0.6, 2.0])
def test_large_beam_finds_the_brute_force_optimum(params, alpha):
  # 2^5 = 32 sequences of the longest length: a beam of 64 never prunes.
  tokens, scores, _ = decode.beam_search(CONFIG, params, SOURCES, beam_size=64, alpha=alpha,
                                         extra_length=2)
  for row, source in enumerate(SOURCES):
    best_score, best_tokens = brute_force_best(params, source, 2, alpha)
    assert strip(tokens[row, 0]) == best_tokens
    assert float(scores[row, 0]) == pytest.approx(best_score, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('extra', [0, 2, 5])
def test_outputs_stop_at_source_length_plus_extra(extra):
  config, params = always_predicting(2)  # never wants to stop
  limits = [int(n) + extra for n in (SOURCES > 0).sum(-1)]
  greedy = sampling.greedy_search(config, params, SOURCES, extra_length=extra)
  # With EOS last, no beam of 2 can finish before the limit.
  beam, _, steps = decode.beam_search(config, params, SOURCES, beam_size=2, extra_length=extra)
  for out in (greedy, beam[:, 0]):
    assert out.shape == (3, SOURCES.shape[1] + extra)
    assert [len(strip(row)) for row in out] == limits
    assert all(strip(row)[:-1] == [2] * (len(strip(row)) - 1) for row in out)
  assert int(steps) == max(limits)


@pytest.mark.slow
def test_beam_search_stops_once_nothing_alive_can_win():
  config, params = always_predicting(decode.EOS_ID)
  tokens, _, steps = decode.beam_search(config, params, SOURCES, beam_size=4, extra_length=50)
  assert [strip(row) for row in tokens[:, 0]] == [[decode.EOS_ID]] * 3
  # EOS wins at the first step; every other continuation is 16 nats behind and can only fall.
  assert int(steps) == 1


def test_length_penalty_is_gnmts():
  assert float(decode.length_penalty(1, 0.6)) == pytest.approx(1.0)
  assert float(decode.length_penalty(7, 0.6)) == pytest.approx(2.0**0.6)
  assert float(decode.length_penalty(10, 0.0)) == 1.0


class PreviousTokenScorer:
  """A hand-built model: the next token's probabilities depend on the previous token only."""

  def __init__(self, table, rows: int):
    self.table = jnp.log(jnp.asarray(table))
    self.initial_cache = jnp.zeros(rows)  # nothing to remember

  def logits(self, cache, tokens):
    return self.table[tokens], cache  # log-probabilities are logits too

  reorder = resize = staticmethod(lambda cache, _: cache)


@pytest.mark.parametrize('beam_size', [1, 2])
def test_a_longer_hypothesis_found_after_beam_finished_ones_wins(beam_size):
  # Tokens: 0 start/pad, 1 EOS, 2-4 words A, B, C; table[previous][next]. EOS alone finishes
  # first, and with beam 2 "B EOS" finishes next, but with alpha=2 "A C EOS" scores best.
  tiny = 1e-6
  table = np.array([[tiny, 0.40, 0.35, 0.25, tiny],   # after the start symbol
                    [tiny] * 5,                        # after EOS (never read)
                    [tiny, 0.30, tiny, tiny, 0.70],   # after A
                    [tiny, 0.99, tiny, tiny, tiny],   # after B
                    [tiny, 0.99, tiny, tiny, tiny]])  # after C
  table /= table.sum(1, keepdims=True)  # probabilities: the search normalizes the scorer's logits
  limit, alpha = 6, 2.0
  scorer = PreviousTokenScorer(table, beam_size)
  tokens, scores, _ = jax.jit(decode.search, static_argnums=(0, 2, 3, 4))(
      scorer, jnp.array([limit]), beam_size, alpha, (limit,))

  def score(sequence):
    previous = [0] + sequence[:-1]
    return np.log(table[previous, sequence]).sum() / float(decode.length_penalty(len(sequence),
                                                                                 alpha))
  candidates = [list(body) + [decode.EOS_ID] for length in range(limit)
                for body in itertools.product([2, 3, 4], repeat=length)]
  best = max(candidates, key=score)
  assert best == [2, 4, decode.EOS_ID]
  assert score(best) > score([decode.EOS_ID]) > score([3, decode.EOS_ID])
  assert strip(tokens[0, 0]) == best
  assert float(scores[0, 0]) == pytest.approx(score(best), abs=1e-5)


@pytest.mark.slow
def test_beam_search_with_the_fused_attention_finds_what_it_finds_with_xlas():
  # The encoder's attention runs the Pallas kernels (interpreted off a GPU); decoding runs XLA's
  # attention over its caches either way.
  config = CONFIG.replace(d_model=32, num_heads=2)  # heads of 16: the kernels' smallest
  params = Transformer(config).init(jax.random.key(3), SOURCES, SOURCES)['params']
  params = jax.tree_util.tree_map(lambda x: 4 * x, params)
  (xla_tokens, xla_scores, _), (fused_tokens, fused_scores, _) = (
      decode.beam_search(config.replace(attention_implementation=name), params, SOURCES,
                         beam_size=2, alpha=0.6, extra_length=3) for name in ('xla', 'pallas'))
  np.testing.assert_array_equal(fused_tokens, xla_tokens)
  np.testing.assert_allclose(fused_scores, xla_scores, atol=1e-5)


def brute_force_ranking(params, source, extra_length, alpha):
  """(score, sequence) of every sequence up to the length limit (EOS last), best first."""
  limit = int((source > 0).sum()) + extra_length
  sequences = [list(body) + [decode.EOS_ID] for length in range(limit)
               for body in itertools.product([2, 3], repeat=length)]
  scores = sequence_log_probs(params, source, sequences) / np.array(
      [float(decode.length_penalty(len(seq), alpha)) for seq in sequences])
  return sorted(zip(scores.tolist(), sequences), key=lambda pair: -pair[0])


@pytest.mark.slow
def test_nbest_of_an_unpruned_beam_are_the_brute_force_ranking(params):
  tokens, scores, _ = decode.beam_search(CONFIG, params, SOURCES, beam_size=64, alpha=0.6,
                                         extra_length=2, nbest=6)
  assert tokens.shape == (3, 6, SOURCES.shape[1] + 2) and scores.shape == (3, 6)
  for row, source in enumerate(SOURCES):
    ranking = brute_force_ranking(params, source, 2, 0.6)[:6]
    np.testing.assert_allclose(scores[row], [score for score, _ in ranking], atol=1e-4)
    assert [strip(hypothesis) for hypothesis in tokens[row]] == [seq for _, seq in ranking]


@pytest.mark.slow
@pytest.mark.parametrize('nbest', [2, 4])
def test_the_first_of_the_nbest_is_the_1_best_exactly(params, nbest):
  one = decode.beam_search(CONFIG, params, SOURCES, beam_size=4, extra_length=6)
  several = decode.beam_search(CONFIG, params, SOURCES, beam_size=4, extra_length=6, nbest=nbest)
  np.testing.assert_array_equal(several[0][:, 0], one[0][:, 0])
  np.testing.assert_array_equal(several[1][:, 0], one[1][:, 0])
  assert (np.diff(np.asarray(several[1]), axis=1) <= 0).all()  # best first
  assert int(several[2]) >= int(one[2])  # the n-th best is final later than the best


def test_nbest_beyond_the_beam_is_refused(params):
  with pytest.raises(ValueError, match='nbest=3: a beam of 2 keeps 1 to 2 hypotheses'):
    decode.beam_search(CONFIG, params, SOURCES, beam_size=2, nbest=3)


@pytest.mark.slow
def test_draws_come_from_the_renormalized_top_k_and_top_p_tokens():
  logits = jnp.log(jnp.array([[0.05, 0.4, 0.3, 0.15, 0.1]]))
  keys = jax.random.split(jax.random.key(0), 20000)
  rows = jnp.repeat(logits, 20000, axis=0)
  kept_probs = {  # (temperature, top_k, top_p): the distribution drawn from
      (1.0, 0, 1.0): [0.05, 0.4, 0.3, 0.15, 0.1],
      (1.0, 2, 1.0): [0, 0.4 / 0.7, 0.3 / 0.7, 0, 0],
      (1.0, 0, 0.8): [0, 0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0],  # 0.4 + 0.3 < 0.8 <= 0.85
      (1.0, 0, 0.7): [0, 0.4 / 0.7, 0.3 / 0.7, 0, 0],  # reached exactly: no more
      (1.0, 3, 0.5): [0, 0.4 / 0.7, 0.3 / 0.7, 0, 0],
      (2.0, 0, 1.0): np.sqrt([0.05, 0.4, 0.3, 0.15, 0.1]) / np.sqrt(
          [0.05, 0.4, 0.3, 0.15, 0.1]).sum(),
  }
  for (temperature, top_k, top_p), probs in kept_probs.items():
    drawn = np.asarray(jax.jit(sampling.draw, static_argnums=(2, 3, 4))(
        rows, keys, temperature, top_k, top_p))
    counts = np.bincount(drawn, minlength=5) / len(drawn)
    np.testing.assert_allclose(counts, probs, atol=0.015, err_msg=str((temperature, top_k, top_p)))
    assert (counts[np.asarray(probs) == 0] == 0).all()
  for temperature, top_k in ((0.0, 0), (1.0, 1), (5.0, 1)):
    assert (np.asarray(sampling.draw(rows[:50], keys[:50], temperature, top_k)) == 1).all()


# Few, some or most tokens in the nucleus; rows of each kind.
@pytest.mark.parametrize('scales', [(8.0,) * 6, (2.0,) * 6, (0.1,) * 6, (8.0, 0.1, 8.0, 2.0, 8.0, 8.0),
                                    (2.0, 8.0, 8.0, 8.0, 8.0, 8.0)])
# Six rows within their candidates, or beyond them: one, two or three gathered (with repeats of
# row 0, beyond or not), or more, all bisected.
@pytest.mark.slow
@pytest.mark.parametrize('candidates', [4, 64])
def test_the_nucleus_floor_is_the_sorted_rows_whatever_path_finds_it(scales, candidates):
  logits = jnp.array(scales)[:, None] * jax.random.normal(jax.random.key(3), (6, 300))
  for top_p in (0.3, 0.9, 0.99):
    probs = np.asarray(jax.nn.softmax(logits))
    order = np.argsort(-probs, axis=-1, kind='stable')
    above = np.cumsum(np.take_along_axis(probs, order, -1), -1) - np.take_along_axis(probs, order,
                                                                                     -1)
    expected = np.array([np.asarray(logits)[row, order[row, above[row] < top_p]].min()
                         for row in range(len(logits))])
    floor = jax.jit(sampling._nucleus_floor, static_argnums=(1, 2))(logits, top_p, candidates)
    np.testing.assert_array_equal(np.asarray(floor)[:, 0], expected, err_msg=str(top_p))


@pytest.mark.slow
@pytest.mark.parametrize('settings', [{'temperature': 0.0}, {'top_k': 1}, {'top_k': 1,
                                                                           'top_p': 0.5}])
def test_sampling_at_temperature_0_or_top_k_1_is_greedy_search(params, settings):
  greedy = sampling.greedy_search(CONFIG, params, SOURCES, extra_length=5)
  keys = jax.random.split(jax.random.key(7), 6).reshape(3, 2)
  tokens, _ = sampling.sample(CONFIG, params, SOURCES, keys, extra_length=5, **settings)
  np.testing.assert_array_equal(tokens[:, 0], greedy)
  np.testing.assert_array_equal(tokens[:, 1], greedy)


@pytest.mark.slow
def test_a_sample_depends_on_its_key_alone_and_has_the_models_log_probability():
  params = Transformer(CONFIG).init(jax.random.key(5), SOURCES, SOURCES)['params']  # unscaled
  keys = jax.random.split(jax.random.key(1), 12).reshape(3, 4)
  tokens, log_probs = sampling.sample(CONFIG, params, SOURCES, keys, temperature=3.0, extra_length=4)
  assert len({tuple(strip(row)) for row in tokens.reshape(12, -1)}) > 3  # they differ
  for row, source in enumerate(SOURCES):
    # Alone in its batch, with a cache grown in other stages: the same draws.
    alone, _ = sampling.sample(CONFIG, params, source[None], keys[row][None, 2:3], temperature=3.0,
                             extra_length=4, cache_stage=2)
    assert strip(alone[0, 0]) == strip(tokens[row, 2])
    expected = sequence_log_probs(params, source, [strip(t) for t in tokens[row]])
    np.testing.assert_allclose(log_probs[row], expected, atol=1e-5)


@pytest.mark.slow
def test_an_ensemble_of_a_model_with_itself_decodes_as_the_model(params):
  ensemble = ((CONFIG, CONFIG), (params, params))
  for alone, together in (
      (decode.beam_search(CONFIG, params, SOURCES, beam_size=3, extra_length=4, nbest=2),
       decode.beam_search(*ensemble, SOURCES, beam_size=3, extra_length=4, nbest=2)),
      (sampling.sample(CONFIG, params, SOURCES, jax.random.split(jax.random.key(2), 3)[:, None]),
       sampling.sample(*ensemble, SOURCES, jax.random.split(jax.random.key(2), 3)[:, None])),
      ((decode.sequence_log_probs(CONFIG, params, SOURCES, SOURCES),),
       (decode.sequence_log_probs(*ensemble, SOURCES, SOURCES),))):
    for a, b in zip(alone, together):
      np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_an_ensemble_scores_with_the_renormalized_mean_of_its_models_log_probabilities(params):
  other = Transformer(CONFIG).init(jax.random.key(9), SOURCES, SOURCES)['params']
  other = jax.tree_util.tree_map(lambda x: 4 * x, other)
  models = ((CONFIG, CONFIG), (params, other))
  tokens, scores, _ = decode.beam_search(*models, SOURCES, beam_size=64, alpha=0.6,
                                         extra_length=2)
  targets = jnp.array([list(row[0]) for row in np.asarray(tokens)])
  mean = sum(jax.nn.log_softmax(Transformer(CONFIG).apply({'params': p}, SOURCES, targets))
             for p in (params, other)) / 2
  expected = np.asarray((jnp.take_along_axis(jax.nn.log_softmax(mean), targets[..., None],
                                             -1)[..., 0] * (targets > 0)).sum(-1))
  np.testing.assert_allclose(decode.sequence_log_probs(*models, SOURCES, targets), expected,
                             atol=1e-5)
  lengths = (np.asarray(targets) > 0).sum(-1)
  np.testing.assert_allclose(scores[:, 0], expected / np.asarray(decode.length_penalty(lengths,
                                                                                       0.6)),
                             atol=1e-5)
  # Neither model alone: its best differs from one model's for some source.
  alone = [decode.beam_search(CONFIG, p, SOURCES, beam_size=64, alpha=0.6, extra_length=2)[0]
           for p in (params, other)]
  assert any((np.asarray(a[:, 0]) != np.asarray(tokens[:, 0])).any() for a in alone)
