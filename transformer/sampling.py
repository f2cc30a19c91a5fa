"""Sampling (temperature, top-k, nucleus) and greedy search over the model's key/value cache
(decode.py's cached decoder, whose conventions they keep: outputs end with EOS and are padded with
0; tuples of models decode as their ensemble).

Written by hand: no library draws from a Flax model's cached decoder; the nucleus is found without
sorting the vocabulary (`_nucleus_floor`).
"""

import functools

import jax
import jax.numpy as jnp

from transformer import decode, kernels
from transformer.model import TransformerConfig


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
  before = jnp.where(chosen > 0, jnp.take_along_axis(
      block_sums, jnp.maximum(chosen - 1, 0)[:, None], axis=1)[:, 0], 0.0)
  within = jnp.take_along_axis(probs, chosen[:, None, None], axis=1)[:, 0]
  return chosen * block + first_reaching(jnp.cumsum(within, axis=-1), target - before)


@functools.partial(jax.jit, static_argnames=('config', 'temperature', 'top_k', 'top_p',
                                             'extra_length', 'cache_stage'))
def sample(config: TransformerConfig, params, sources, keys, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, extra_length: int = 50,
           cache_stage: int = decode.CACHE_STAGE):
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
  stage_ends = decode.stage_ends_of(sources.shape[1] + extra_length, cache_stage)
  decoder = decode.cached_decoder(config, params, sources, samples, stage_ends[0])
  limits = jnp.repeat(decode.max_output_lengths(sources, extra_length), samples)
  keys = keys.reshape(-1)

  def step(state):
    position, tokens, log_probs, done, cache = state
    last = jax.lax.dynamic_index_in_dim(tokens, jnp.maximum(position - 1, 0), axis=1,
                                        keepdims=False)
    logits, cache = decoder.logits(cache, jnp.where(position == 0, 0, last))
    # A finished row draws EOS, as at its limit (then PAD): a nucleus of one token, however flat
    # its distribution after EOS.
    allowed = decode.allowed(jnp.arange(logits.shape[-1]),
                             ((position + 1 >= limits) | done)[:, None])
    token = draw(jnp.where(allowed, logits, -jnp.inf),
                 jax.vmap(jax.random.fold_in, (0, None))(keys, position), temperature, top_k,
                 top_p)
    token = jnp.where(done, decode.PAD_ID, token)
    # Under the model, as beam search scores: normalized over every token, allowed or not.
    token_log_prob = (jnp.take_along_axis(logits, token[:, None], axis=1)[:, 0] -
                      jax.nn.logsumexp(logits, axis=-1))
    log_probs = log_probs + jnp.where(done, 0.0, token_log_prob)
    tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, position, axis=1)
    return position + 1, tokens, log_probs, done | (token == decode.EOS_ID), cache

  rows = batch * samples
  state = (jnp.array(0), jnp.zeros((rows, stage_ends[-1]), jnp.int32), jnp.zeros(rows),
           jnp.zeros(rows, bool), decoder.initial_cache)
  _, tokens, log_probs, _, _ = decode.in_stages(decoder, state, step,
                                                 lambda state: ~state[3].all(), stage_ends)
  return tokens.reshape(batch, samples, -1), log_probs.reshape(batch, samples)


def greedy_search(config: TransformerConfig, params, sources, extra_length: int = 50):
  """The most probable token at each step, until EOS or the length limit: `sample` at
  temperature 0. Returns [batch, source_length + extra_length] output ids."""
  keys = jnp.broadcast_to(jax.random.key(0), (sources.shape[0], 1))  # not drawn from
  return sample(config, params, sources, keys, temperature=0.0, extra_length=extra_length)[0][:, 0]
