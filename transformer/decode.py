"""Greedy and beam-search decoding over the model's key/value cache (section 6.1).

Outputs are [batch, length] token ids ending with EOS (1) and padded with 0. The longest output of
a sentence is its source length + `extra_length` tokens, both counting EOS; a beam search stops
once no live hypothesis can still beat the best finished one.

Written by hand: neither flax nor optax ships a beam search; this one follows the paper (GNMT
length penalty, early stop) and reorders the cache with one gather per step.
"""

import functools

import jax
import jax.numpy as jnp

from transformer import kernels
from transformer.model import Transformer, TransformerConfig

PAD_ID, EOS_ID = 0, 1
NEG_INF = -1.0e7  # large but finite: -inf - -inf would give NaN in score arithmetic
# Beam search's self-attention caches grow by this many positions at a time: each step reads the
# cache and the beam reorder copies it, so a short cache early on saves memory traffic.
CACHE_STAGE = 16


def length_penalty(length, alpha: float):
  """GNMT (Wu et al. 2016): ((5 + |Y|) / 6)^alpha."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def max_output_lengths(sources, extra_length: int):
  """Per sentence: source length (with its EOS) + extra_length."""
  return (sources > 0).sum(-1) + extra_length


class _Scorer:
  """The cached decoder of one model and batch: set up once, then one position per call."""

  def __init__(self, config: TransformerConfig, params, sources, copies: int, cache_length: int):
    model = Transformer(config.replace(deterministic=True, decode=False))
    self.model = Transformer(config.replace(deterministic=True, decode=True))
    self.params = params
    encoded = model.apply({'params': params}, sources, method=Transformer.encode)
    repeat = lambda x: jnp.repeat(x, copies, axis=0)  # rows of one sentence next to each other
    self.encoded, self.sources = repeat(encoded), repeat(sources)
    placeholder = jnp.zeros((self.sources.shape[0], cache_length), jnp.int32)
    _, variables = self.model.apply({'params': params}, self.encoded, self.sources, placeholder,
                                    method=Transformer.decode, mutable=['cache'])
    self.initial_cache = variables['cache']

  def logits(self, cache, tokens):
    """(float32 logits [rows, vocab] of the next token after `tokens` [rows], new cache)."""
    logits, variables = self.model.apply(
        {'params': self.params, 'cache': cache}, self.encoded, self.sources, tokens[:, None],
        method=Transformer.decode, mutable=['cache'])
    return logits[:, 0], variables['cache']

  @staticmethod
  def reorder(cache, rows):
    """The cache of rows `rows` [batch * beam] of [batch * beam, ...]: self-attention caches
    follow their beams; cross-attention ones are the same for all."""
    # Whole rows: a row copy, where a gather inside [batch, beam, ...] runs element by element.
    def gather(path, x):
      if x.ndim == 0 or any(getattr(k, 'key', None) == 'cross_attention' for k in path):
        return x
      return jnp.take(x, rows, axis=0, mode='clip')  # in bounds: no fill mask to apply
    return jax.tree_util.tree_map_with_path(gather, cache)

  @staticmethod
  def resize(cache, length: int):
    """The decoding cache with room for `length` target positions: the self-attention caches cut
    or zero-padded at the end (positions past the decoding index are never read)."""
    def resize_one(path, x):
      names = [getattr(k, 'key', None) for k in path]
      if 'self_attention' not in names:
        return x
      # Keys [batch, heads, depth, length], values [batch, heads, length, depth].
      axis = 3 if names[-1] == 'cached_key' else 2
      if x.shape[axis] >= length:
        return jax.lax.slice_in_dim(x, 0, length, axis=axis)
      pad = [(0, 0)] * x.ndim
      pad[axis] = (0, length - x.shape[axis])
      return jnp.pad(x, pad)
    return jax.tree_util.tree_map_with_path(resize_one, cache)


def _gather_beams(x, beams):
  """x[b, beams[b, i], ...] for x of shape [batch, beam, ...] and beams of shape [batch, k]."""
  return jnp.take_along_axis(x, beams.reshape(beams.shape + (1,) * (x.ndim - 2)), axis=1)


def _allowed(ids, at_limit):
  """Never the pad id; at the length limit only EOS."""
  return (ids != PAD_ID) & ~(at_limit & (ids != EOS_ID))


def best_continuations(logits, live_log_probs, at_limit, k: int):
  """The k best allowed continuations of each sentence's live hypotheses.

  `lax.top_k` over `live_log_probs + log_softmax(logits)` [batch, beam * vocab], without that
  array: each beam's row differs from its log-probabilities by one constant, so the k best of
  the row hold the beam's share of the k best, and only those k are normalized. The [rows,
  vocab] log-probabilities and candidates are then never written: passes that, on CPUs, took
  about as long as the rest of the step outside the output projection.

  Args:
    logits: [batch * beam, vocab] float32, rows of one sentence next to each other.
    live_log_probs: [batch, beam] the live hypotheses' log-probabilities.
    at_limit: [batch, 1, 1] True where only EOS may come next (`_allowed`).
    k: how many.

  Returns:
    (log-probabilities [batch, k] of the hypotheses extended, descending, disallowed tokens at
    live + NEG_INF; their beams [batch, k]; their tokens [batch, k]), in lax.top_k's order, ties
    to the lower beam then token, but for log-probabilities that round equal from unequal logits.
  """
  batch, beam = live_log_probs.shape
  logits = logits.reshape(batch, beam, -1)
  vocab = logits.shape[-1]
  # log_softmax's own arithmetic (jax.nn.log_softmax), for the k best only.
  row_max = logits.max(-1, keepdims=True)
  log_sum = jnp.log(jnp.exp(logits - row_max).sum(-1, keepdims=True))
  ranked = jnp.where(_allowed(jnp.arange(vocab), at_limit), logits, -jnp.inf)
  row_k = min(k, vocab)
  values, tokens = kernels.top_k(ranked.reshape(batch * beam, vocab), row_k)  # lax.top_k's
  values, tokens = values.reshape(batch, beam, row_k), tokens.reshape(batch, beam, row_k)
  log_probs = jnp.where(_allowed(tokens, at_limit), (values - row_max) - log_sum, NEG_INF)
  best, position = jax.lax.top_k((live_log_probs[:, :, None] + log_probs).reshape(batch, -1), k)
  token = jnp.take_along_axis(tokens.reshape(batch, -1), position, axis=1)
  return best, position // row_k, token


@functools.partial(jax.jit, static_argnames=('config', 'extra_length'))
def greedy_search(config: TransformerConfig, params, sources, extra_length: int = 50):
  """The most probable token at each step, until EOS or the length limit.

  Args:
    config: the model's architecture.
    params: its parameters.
    sources: [batch, source_length] source ids ending in EOS, 0 = padding.
    extra_length: outputs hold at most source length + extra_length tokens (EOS included).

  Returns:
    [batch, source_length + extra_length] output ids, each row ending with EOS then padding.
  """
  batch, length = sources.shape[0], sources.shape[1] + extra_length
  scorer = _Scorer(config, params, sources, 1, length)
  limits = max_output_lengths(sources, extra_length)

  def step(carry, position):
    cache, token, done = carry
    logits, cache = scorer.logits(cache, token)
    allowed = _allowed(jnp.arange(logits.shape[-1]), (position + 1 >= limits)[:, None])
    token = jnp.where(done, 0, jnp.argmax(jnp.where(allowed, logits, -jnp.inf), -1))
    return (cache, token, done | (token == EOS_ID)), token

  init = (scorer.initial_cache, jnp.zeros(batch, jnp.int32), jnp.zeros(batch, bool))
  _, tokens = jax.lax.scan(step, init, jnp.arange(length))
  return tokens.T


@functools.partial(jax.jit, static_argnames=('config', 'beam_size', 'alpha', 'extra_length',
                                             'cache_stage'))
def beam_search(config: TransformerConfig, params, sources, beam_size: int = 4, alpha: float = 0.6,
                extra_length: int = 50, cache_stage: int = CACHE_STAGE):
  """The best hypothesis of each sentence by log-probability / length_penalty (section 6.1).

  Args:
    config: the model's architecture.
    params: its parameters.
    sources: [batch, source_length] source ids ending in EOS, 0 = padding.
    beam_size: hypotheses kept per sentence.
    alpha: the length penalty's exponent (`length_penalty`).
    extra_length: outputs hold at most source length + extra_length tokens (EOS included).
    cache_stage: the self-attention caches grow by this many positions at a time.

  Returns:
    (tokens [batch, source_length + extra_length], each row ending with EOS then padding;
    scores [batch] float32; the number of decoding steps run).
  """
  length = sources.shape[1] + extra_length
  stage_ends = list(range(cache_stage, length, cache_stage)) + [length]
  scorer = _Scorer(config, params, sources, beam_size, stage_ends[0])
  return search(scorer, max_output_lengths(sources, extra_length), beam_size, alpha, stage_ends)


def search(scorer, limits, beam_size: int, alpha: float, stage_ends: list[int]):
  """Beam search over any scorer with `_Scorer`'s interface: `initial_cache` for batch * beam
  rows, `logits(cache, tokens)`, `reorder(cache, rows)` and `resize(cache, length)`. `limits`
  [batch] are the longest outputs; the search runs in stages, its cache resized to each stage's
  end, the last end being the output length."""
  batch, length = limits.shape[0], stage_ends[-1]
  best_possible_penalty = length_penalty(limits, alpha)

  def sentence_done(live_log_probs, finished_scores):
    """A sentence is done when no live hypothesis can beat its best finished one: log-
    probabilities only fall, and the penalty is largest at the longest allowed length."""
    return live_log_probs[:, 0] / best_possible_penalty <= finished_scores[:, 0]

  def not_done(state):
    position, _, live_log_probs, _, finished_scores, _ = state
    return (position < length) & ~sentence_done(live_log_probs, finished_scores).all()

  def step(state):
    position, live_tokens, live_log_probs, finished_tokens, finished_scores, cache = state
    done = sentence_done(live_log_probs, finished_scores)[:, None]  # frozen from now on
    last = jax.lax.dynamic_index_in_dim(live_tokens, jnp.maximum(position - 1, 0), axis=2,
                                        keepdims=False)
    last = jnp.where(position == 0, 0, last)  # the start symbol
    logits, cache = scorer.logits(cache, last.reshape(-1))
    # 2 * beam candidates always leave at least `beam` that do not end with EOS.
    top_log_probs, top_beams, top_tokens = best_continuations(
        logits, live_log_probs, (position + 1 >= limits)[:, None, None], 2 * beam_size)
    top_sequences = _gather_beams(live_tokens, top_beams)
    top_sequences = jax.lax.dynamic_update_index_in_dim(top_sequences, top_tokens, position, 2)
    ends = top_tokens == EOS_ID

    # Finished: EOS-ending candidates among the best `beam` (so beam 1 is greedy search) join
    # the kept best `beam`. Candidates below NEG_INF / 2 come from empty beams.
    finishing = ends & (jnp.arange(2 * beam_size) < beam_size) & ~done & (
        top_log_probs > NEG_INF / 2)
    new_scores = jnp.where(finishing, top_log_probs / length_penalty(position + 1, alpha),
                           NEG_INF)
    all_scores = jnp.concatenate([finished_scores, new_scores], axis=1)
    all_tokens = jnp.concatenate([finished_tokens, top_sequences], axis=1)
    finished_scores, keep = jax.lax.top_k(all_scores, beam_size)
    finished_tokens = _gather_beams(all_tokens, keep)

    # Live: the best `beam` candidates that did not end.
    live_log_probs, keep = jax.lax.top_k(jnp.where(ends, NEG_INF, top_log_probs), beam_size)
    live_tokens = _gather_beams(top_sequences, keep)
    beams = jnp.take_along_axis(top_beams, keep, axis=1)
    cache = scorer.reorder(cache, (jnp.arange(batch)[:, None] * beam_size + beams).reshape(-1))
    return position + 1, live_tokens, live_log_probs, finished_tokens, finished_scores, cache

  # Only the first live beam starts alive, so the first step does not pick one token `beam` times.
  live_log_probs = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam_size - 1)), (batch, 1))
  tokens = jnp.zeros((batch, beam_size, length), jnp.int32)
  state = (jnp.array(0), tokens, live_log_probs, tokens,
           jnp.full((batch, beam_size), NEG_INF), scorer.initial_cache)
  for end in stage_ends:  # each stage a loop with a cache of `end` positions
    state = state[:-1] + (scorer.resize(state[-1], end),)
    state = jax.lax.while_loop(lambda state, end=end: not_done(state) & (state[0] < end), step,
                               state)
  steps, _, _, finished_tokens, finished_scores, _ = state
  return finished_tokens[:, 0], finished_scores[:, 0], steps
