"""Beam search (section 6.1) over the model's key/value cache, and the log-probability of given
outputs; sampling and greedy search over the same cache: sampling.py.

Outputs are token ids ending with EOS (1) and padded with 0. The longest output of a sentence is
its source length + `extra_length` tokens, both counting EOS; a beam search stops once no live
hypothesis can still beat the n-th best finished one, sampling once every row has ended.

Wherever a function takes `config` and `params`, tuples of several models' (sharing one
vocabulary) decode with their ensemble: the mean of their logits, whose log_softmax is the
normalized mean of their log-probabilities (each model's log-normalizer is one constant per row).

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


class _CachedDecoder:
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


class _EnsembleDecoder:
  """Several models' `_CachedDecoder`s as one, with its interface: the mean of their logits, a
  tuple of their caches."""

  def __init__(self, decoders: list[_CachedDecoder]):
    self.decoders = decoders
    self.initial_cache = tuple(decoder.initial_cache for decoder in decoders)

  def logits(self, cache, tokens):
    outputs = [decoder.logits(c, tokens) for decoder, c in zip(self.decoders, cache)]
    # The mean of one model's logits twice is its logits, exactly: an ensemble of a run with
    # itself decodes as the run.
    return (jnp.mean(jnp.stack([logits for logits, _ in outputs]), axis=0),
            tuple(c for _, c in outputs))

  reorder = staticmethod(_CachedDecoder.reorder)  # tree maps: a tuple of caches is one tree
  resize = staticmethod(_CachedDecoder.resize)


def cached_decoder(config, params, sources, copies: int, cache_length: int):
  """The cached decoder of one model, or of an ensemble where `config` and `params` are tuples."""
  if isinstance(config, tuple):
    return _EnsembleDecoder([_CachedDecoder(c, p, sources, copies, cache_length)
                             for c, p in zip(config, params)])
  return _CachedDecoder(config, params, sources, copies, cache_length)


def stage_ends_of(length: int, cache_stage: int) -> list[int]:
  """Where the self-attention caches of a decoding of `length` positions grow."""
  return list(range(cache_stage, length, cache_stage)) + [length]


def in_stages(decoder, state: tuple, step, running, stage_ends: list[int]) -> tuple:
  """`state` [position, ..., cache] after `step` has run while `running(state)` and position is
  below the last stage end; the cache resized to each stage's end before the loop of that stage
  (each stage a loop of its own shapes)."""
  for end in stage_ends:
    state = state[:-1] + (decoder.resize(state[-1], end),)
    state = jax.lax.while_loop(lambda state, end=end: running(state) & (state[0] < end), step,
                               state)
  return state


def _gather_beams(x, beams):
  """x[b, beams[b, i], ...] for x of shape [batch, beam, ...] and beams of shape [batch, k]."""
  return jnp.take_along_axis(x, beams.reshape(beams.shape + (1,) * (x.ndim - 2)), axis=1)


def allowed(ids, at_limit):
  """Never the pad id; at the length limit only EOS."""
  return (ids != PAD_ID) & ~(at_limit & (ids != EOS_ID))


@functools.partial(jax.jit, static_argnames=('config', 'beam_size', 'alpha', 'extra_length',
                                             'cache_stage', 'nbest'))
def beam_search(config: TransformerConfig, params, sources, beam_size: int = 4, alpha: float = 0.6,
                extra_length: int = 50, cache_stage: int = CACHE_STAGE, nbest: int = 1):
  """The best hypotheses of each sentence by log-probability / length_penalty (section 6.1).

  Args:
    config: the model's architecture (a tuple: an ensemble's).
    params: its parameters (a tuple: an ensemble's).
    sources: [batch, source_length] source ids ending in EOS, 0 = padding.
    beam_size: hypotheses kept per sentence.
    alpha: the length penalty's exponent (`length_penalty`).
    extra_length: outputs hold at most source length + extra_length tokens (EOS included).
    cache_stage: the self-attention caches grow by this many positions at a time.
    nbest: how many of the best finished hypotheses to return, at most beam_size.

  Returns:
    (tokens [batch, nbest, source_length + extra_length], best first, each row ending with EOS
    then padding; their scores [batch, nbest] float32, NEG_INF where fewer were found; the number
    of decoding steps run).
  """
  stage_ends = stage_ends_of(sources.shape[1] + extra_length, cache_stage)
  decoder = cached_decoder(config, params, sources, beam_size, stage_ends[0])
  return search(decoder, max_output_lengths(sources, extra_length), beam_size, alpha, stage_ends,
                nbest)


def search(decoder, limits, beam_size: int, alpha: float, stage_ends: list[int], nbest: int = 1):
  """Beam search over any cached decoder (`_CachedDecoder`'s interface: `initial_cache` for batch *
  beam rows, `logits(cache, tokens)`, `reorder(cache, rows)` and `resize(cache, length)`). `limits`
  [batch] are the longest outputs; the search runs in stages, its cache resized to each stage's
  end, the last end being the output length; a sentence is done once its `nbest` best finished
  hypotheses are final."""
  if not 1 <= nbest <= beam_size:
    raise ValueError(f'nbest={nbest}: a beam of {beam_size} keeps 1 to {beam_size} hypotheses')
  batch, length = limits.shape[0], stage_ends[-1]
  best_possible_penalty = length_penalty(limits, alpha)

  def sentence_done(live_log_probs, finished_scores):
    """A sentence is done when no live hypothesis can beat its nbest-th finished one: log-
    probabilities only fall, and the penalty is largest at the longest allowed length."""
    return live_log_probs[:, 0] / best_possible_penalty <= finished_scores[:, nbest - 1]

  def step(state):
    position, live_tokens, live_log_probs, finished_tokens, finished_scores, cache = state
    done = sentence_done(live_log_probs, finished_scores)[:, None]  # frozen from now on
    last = jax.lax.dynamic_index_in_dim(live_tokens, jnp.maximum(position - 1, 0), axis=2,
                                        keepdims=False)
    last = jnp.where(position == 0, 0, last)  # the start symbol
    logits, cache = decoder.logits(cache, last.reshape(-1))
    # The 2 * beam best of live_log_probs + log_softmax(logits) over each sentence's beams and
    # allowed tokens (always at least `beam` that do not end with EOS), beam and token apart.
    at_limit = (position + 1 >= limits)[:, None, None]
    allowed_tokens = allowed(jnp.arange(logits.shape[-1]), at_limit)
    top_log_probs, top_beams, top_tokens = kernels.best_continuations(
        logits, live_log_probs, allowed_tokens, 2 * beam_size, NEG_INF)
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
    cache = decoder.reorder(cache, (jnp.arange(batch)[:, None] * beam_size + beams).reshape(-1))
    return position + 1, live_tokens, live_log_probs, finished_tokens, finished_scores, cache

  # Only the first live beam starts alive, so the first step does not pick one token `beam` times.
  live_log_probs = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam_size - 1)), (batch, 1))
  tokens = jnp.zeros((batch, beam_size, length), jnp.int32)
  state = (jnp.array(0), tokens, live_log_probs, tokens,
           jnp.full((batch, beam_size), NEG_INF), decoder.initial_cache)
  running = lambda state: ~sentence_done(state[2], state[4]).all()
  steps, _, _, finished_tokens, finished_scores, _ = in_stages(decoder, state, step, running,
                                                                stage_ends)
  return finished_tokens[:, :nbest], finished_scores[:, :nbest], steps


@functools.partial(jax.jit, static_argnames=('config',))
def sequence_log_probs(config: TransformerConfig, params, sources, targets):
  """log P(target | source) of each row, summed over its tokens, from one teacher-forced pass.

  Args:
    config: the model's architecture (a tuple: an ensemble's).
    params: its parameters (a tuple: an ensemble's).
    sources: [batch, source_length] source ids ending in EOS, 0 = padding.
    targets: [batch, target_length] target ids ending in EOS, 0 = padding.

  Returns:
    [batch] float32.
  """
  configs, params = (config, params) if isinstance(config, tuple) else ((config,), (params,))
  logits = jnp.mean(jnp.stack([
      Transformer(c.replace(deterministic=True, decode=False)).apply({'params': p}, sources,
                                                                       targets)
      for c, p in zip(configs, params)]), axis=0)
  log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)
  return jnp.where(targets > 0, log_probs[..., 0], 0.0).sum(-1)
