"""Beam search (section 6.1), sampling and greedy search over the model's key/value cache, and the
log-probability of given outputs.

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


class _Ensemble:
  """Several models' `_Scorer`s as one, with `_Scorer`'s interface: the mean of their logits, a
  tuple of their caches."""

  def __init__(self, scorers: list[_Scorer]):
    self.scorers = scorers
    self.initial_cache = tuple(scorer.initial_cache for scorer in scorers)

  def logits(self, cache, tokens):
    outputs = [scorer.logits(c, tokens) for scorer, c in zip(self.scorers, cache)]
    # The mean of one model's logits twice is its logits, exactly: an ensemble of a run with
    # itself decodes as the run.
    return (jnp.mean(jnp.stack([logits for logits, _ in outputs]), axis=0),
            tuple(c for _, c in outputs))

  reorder = staticmethod(_Scorer.reorder)  # tree maps: a tuple of caches is one tree
  resize = staticmethod(_Scorer.resize)


def _scorer(config, params, sources, copies: int, cache_length: int):
  """The cached decoder of one model, or of an ensemble where `config` and `params` are tuples."""
  if isinstance(config, tuple):
    return _Ensemble([_Scorer(c, p, sources, copies, cache_length)
                      for c, p in zip(config, params)])
  return _Scorer(config, params, sources, copies, cache_length)


def _stage_ends(length: int, cache_stage: int) -> list[int]:
  """Where the self-attention caches of a decoding of `length` positions grow."""
  return list(range(cache_stage, length, cache_stage)) + [length]


def _in_stages(scorer, state: tuple, step, running, stage_ends: list[int]) -> tuple:
  """`state` [position, ..., cache] after `step` has run while `running(state)` and position is
  below the last stage end; the cache resized to each stage's end before the loop of that stage
  (each stage a loop of its own shapes)."""
  for end in stage_ends:
    state = state[:-1] + (scorer.resize(state[-1], end),)
    state = jax.lax.while_loop(lambda state, end=end: running(state) & (state[0] < end), step,
                               state)
  return state


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
  stage_ends = _stage_ends(sources.shape[1] + extra_length, cache_stage)
  scorer = _scorer(config, params, sources, beam_size, stage_ends[0])
  return search(scorer, max_output_lengths(sources, extra_length), beam_size, alpha, stage_ends,
                nbest)


def search(scorer, limits, beam_size: int, alpha: float, stage_ends: list[int], nbest: int = 1):
  """Beam search over any scorer with `_Scorer`'s interface: `initial_cache` for batch * beam
  rows, `logits(cache, tokens)`, `reorder(cache, rows)` and `resize(cache, length)`. `limits`
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
  running = lambda state: ~sentence_done(state[2], state[4]).all()
  steps, _, _, finished_tokens, finished_scores, _ = _in_stages(scorer, state, step, running,
                                                                stage_ends)
  return finished_tokens[:, :nbest], finished_scores[:, :nbest], steps


def draw(logits, keys, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """One token per row of `logits` [rows, vocab]: at temperature 0 the most probable; else a draw
  with `keys` [rows] from softmax(logits / temperature) over the `top_k` most probable tokens
  (0: all of them), then over the fewest most probable whose probability reaches `top_p` (nucleus
  sampling, Holtzman et al. 2020), in Hugging Face's order."""
  if temperature == 0:
    return jnp.argmax(logits, -1)
  logits = logits / temperature
  if top_k:
    kth_best = kernels.top_k(logits, top_k)[0].min(-1, keepdims=True)  # not a slice: see below
    logits = jnp.where(logits >= kth_best, logits, -jnp.inf)
  if top_p < 1:
    logits = jnp.where(logits >= _nucleus_floor(logits, top_p), logits, -jnp.inf)
  return _inverse_cdf_draw(logits, keys)


def _nucleus_floor(logits, top_p: float, candidates: int = 32):
  """[rows, 1]: the least logit of each row's nucleus, the fewest most probable tokens whose
  probability reaches top_p.

  Among the row's `candidates` most probable tokens where they hold top_p, as sharp
  distributions' do; the other rows by bisection over the probabilities' float32 bits (in the
  order of the floats, for non-negative ones), exact in 31 passes over them, gathered into the
  least of rows / 8, rows / 4, rows / 2 or all rows that holds them (a trained model's rows at
  temperature 1 need it in about one case in six). A sort of the vocabulary, the textbook way,
  took 40 times a whole step of sampling on CPUs.
  """
  rows, vocab = logits.shape
  # Reductions of lax.top_k's values, never slices: a slice makes XLA sort the whole row.
  best, _ = kernels.top_k(logits, min(candidates, vocab), block=32)  # descending
  row_max = logits.max(-1, keepdims=True)
  total = jnp.exp(logits - row_max).sum(-1, keepdims=True)
  best_probs = jnp.exp(best - row_max) / total
  above = jnp.cumsum(best_probs, axis=-1) - best_probs  # the probability of the tokens above
  in_candidates = jnp.min(jnp.where(above < top_p, best, jnp.inf), axis=-1, keepdims=True)
  beyond = best_probs.sum(-1) < top_p  # [rows]: the nucleus reaches past the candidates

  def bisection(logits, row_max, total):
    probs = jnp.exp(logits - row_max) / total
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

    def halve(_, bounds):  # the floor's bits lie in [low, high)
      low, high = bounds
      middle = low + (high - low) // 2
      holds = jnp.where(bits >= middle, probs, 0.0).sum(-1, keepdims=True) >= top_p
      return jnp.where(holds, middle, low), jnp.where(holds, high, middle)

    low, _ = jax.lax.fori_loop(0, 31, halve, (jnp.zeros((len(logits), 1), jnp.int32),
                                              bits.max(-1, keepdims=True) + 1))
    return jnp.min(jnp.where(bits >= low, logits, jnp.inf), axis=-1, keepdims=True)

  def gathered(size):  # the rows beyond, then repeats of row 0 (whose floor is left as it is)
    def floors(_):
      which = jnp.nonzero(beyond, size=size, fill_value=0)[0]
      found = bisection(logits[which], row_max[which], total[which])
      return in_candidates.at[which].set(jnp.where(beyond[which, None], found,
                                                   in_candidates[which]))
    return floors

  sizes = sorted({max(1, rows // 8), max(1, rows // 4), max(1, rows // 2)} - {rows})
  branches = ([lambda _: in_candidates] + [gathered(size) for size in sizes] +
              [lambda _: bisection(logits, row_max, total)])
  count = beyond.sum()
  branch = jnp.where(count > 0, 1 + (count > jnp.array(sizes, jnp.int32)).sum(), 0)
  return jax.lax.switch(branch, branches, None)


def _inverse_cdf_draw(logits, keys, block: int = 128):
  """One draw per row of softmax(logits) [rows, vocab], one uniform number per row from `keys`:
  the row's block of `block` tokens by the cumulative sums of the blocks, then the token within
  it. jax.random.categorical draws a Gumbel number per token, which on CPUs took 15 times as
  long."""
  rows, vocab = logits.shape
  blocks = -(-vocab // block)
  probs = jnp.exp(logits - logits.max(-1, keepdims=True))  # unnormalized; 0 where -inf
  probs = jnp.pad(probs, ((0, 0), (0, blocks * block - vocab))).reshape(rows, blocks, block)
  block_sums = jnp.cumsum(probs.sum(-1), axis=-1)
  target = jax.vmap(jax.random.uniform)(keys) * block_sums[:, -1]

  def first_reaching(sums, target):
    """The first position whose cumulative sum exceeds target, of those after a positive term
    (rounding can leave target at or past the last sum)."""
    last_positive = jnp.argmax(jnp.where(jnp.diff(sums, prepend=0.0, axis=-1) > 0,
                                         jnp.arange(sums.shape[-1]), -1), axis=-1)
    return jnp.minimum((sums <= target[:, None]).sum(-1), last_positive)

  chosen = first_reaching(block_sums, target)
  before = jnp.where(chosen > 0, jnp.take_along_axis(block_sums, jnp.maximum(chosen - 1, 0)[:, None],
                                                      axis=1)[:, 0], 0.0)
  within = jnp.take_along_axis(probs, chosen[:, None, None], axis=1)[:, 0]
  return chosen * block + first_reaching(jnp.cumsum(within, axis=-1), target - before)


@functools.partial(jax.jit, static_argnames=('config', 'temperature', 'top_k', 'top_p',
                                             'extra_length', 'cache_stage'))
def sample(config: TransformerConfig, params, sources, keys, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, extra_length: int = 50,
           cache_stage: int = CACHE_STAGE):
  """Outputs drawn token by token (`draw`), one per key; temperature 0 is greedy search.

  Each output's draws come from its own key alone (folded with the position), so an output does
  not depend on the other rows of the batch, nor on the batch's size.

  Args:
    config: the model's architecture (a tuple: an ensemble's).
    params: its parameters (a tuple: an ensemble's).
    sources: [batch, source_length] source ids ending in EOS, 0 = padding.
    keys: [batch, samples] `jax.random.key`s: samples outputs of each source.
    temperature: the logits are divided by it; 0: the most probable token.
    top_k: draw among the top_k most probable tokens; 0: all.
    top_p: then among the fewest most probable whose probability reaches top_p; 1: all.
    extra_length: outputs hold at most source length + extra_length tokens (EOS included).
    cache_stage: the self-attention caches grow by this many positions at a time.

  Returns:
    (tokens [batch, samples, source_length + extra_length], each row ending with EOS then
    padding; their log-probabilities [batch, samples] float32 under the model, without the
    temperature and the restriction to top_k and top_p).
  """
  batch, samples = keys.shape
  stage_ends = _stage_ends(sources.shape[1] + extra_length, cache_stage)
  scorer = _scorer(config, params, sources, samples, stage_ends[0])
  limits = jnp.repeat(max_output_lengths(sources, extra_length), samples)
  keys = keys.reshape(-1)

  def step(state):
    position, tokens, log_probs, done, cache = state
    last = jax.lax.dynamic_index_in_dim(tokens, jnp.maximum(position - 1, 0), axis=1,
                                        keepdims=False)
    logits, cache = scorer.logits(cache, jnp.where(position == 0, 0, last))
    # A finished row draws EOS, as at its limit (then PAD): a nucleus of one token, however flat
    # its distribution after EOS.
    allowed = _allowed(jnp.arange(logits.shape[-1]), ((position + 1 >= limits) | done)[:, None])
    token = draw(jnp.where(allowed, logits, -jnp.inf),
                 jax.vmap(jax.random.fold_in, (0, None))(keys, position), temperature, top_k,
                 top_p)
    token = jnp.where(done, PAD_ID, token)
    # Under the model, as beam search scores: normalized over every token, allowed or not.
    token_log_prob = (jnp.take_along_axis(logits, token[:, None], axis=1)[:, 0] -
                      jax.nn.logsumexp(logits, axis=-1))
    log_probs = log_probs + jnp.where(done, 0.0, token_log_prob)
    tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, position, axis=1)
    return position + 1, tokens, log_probs, done | (token == EOS_ID), cache

  rows = batch * samples
  state = (jnp.array(0), jnp.zeros((rows, stage_ends[-1]), jnp.int32), jnp.zeros(rows),
           jnp.zeros(rows, bool), scorer.initial_cache)
  _, tokens, log_probs, _, _ = _in_stages(scorer, state, step, lambda state: ~state[3].all(),
                                          stage_ends)
  return tokens.reshape(batch, samples, -1), log_probs.reshape(batch, samples)


def greedy_search(config: TransformerConfig, params, sources, extra_length: int = 50):
  """The most probable token at each step, until EOS or the length limit: `sample` at
  temperature 0. Returns [batch, source_length + extra_length] output ids."""
  keys = jnp.broadcast_to(jax.random.key(0), (sources.shape[0], 1))  # not drawn from
  return sample(config, params, sources, keys, temperature=0.0, extra_length=extra_length)[0][:, 0]


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
