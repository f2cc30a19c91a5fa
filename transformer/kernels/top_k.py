"""`jax.lax.top_k` by blocks, for the candidates of a beam search or a sampling step, and a beam
search step's best continuations without their [rows, vocab] log-probabilities."""

import jax
import jax.numpy as jnp


def top_k(x, k: int, block: int = 128):
  """`jax.lax.top_k` over the last axis of x [rows, n]: the same values and indices, ties going
  to the lower index.

  One pass takes the maximum of each block of `block` elements; the k largest lie in the k blocks
  of largest maximum (each block ranked before an element's own holds an element ranked before
  it), whose elements then go through `lax.top_k`. A max over blocks vectorises, where lax.top_k
  over a whole vocabulary of beam candidates is a slow pass on CPUs.
  """
  rows, n = x.shape
  blocks = -(-n // block)
  if blocks <= 2 * k:
    return jax.lax.top_k(x, k)
  grouped = jnp.pad(x, ((0, 0), (0, blocks * block - n)), constant_values=-jnp.inf).reshape(
      rows, blocks, block)
  _, top_blocks = jax.lax.top_k(grouped.max(axis=-1), k)
  top_blocks = jnp.sort(top_blocks, axis=-1)  # candidates in index order: ties as lax.top_k
  candidates = jnp.take_along_axis(grouped, top_blocks[:, :, None], axis=1).reshape(rows, -1)
  values, positions = jax.lax.top_k(candidates, k)
  block_of = jnp.take_along_axis(top_blocks, positions // block, axis=1)
  return values, block_of * block + positions % block


def best_continuations(logits, live_log_probs, allowed, k: int, disallowed: float):
  """The k best allowed continuations of each sentence's live hypotheses.

  `lax.top_k` over `live_log_probs + log_softmax(logits)` [batch, beam * vocab], without that
  array: each beam's row differs from its log-probabilities by one constant, so the k best of
  the row hold the beam's share of the k best, and only those k are normalized. The [rows,
  vocab] log-probabilities and candidates are then never written: passes that, on CPUs, took
  about as long as the rest of the step outside the output projection.

  Args:
    logits: [batch * beam, vocab] float32, rows of one sentence next to each other.
    live_log_probs: [batch, beam] the live hypotheses' log-probabilities.
    allowed: bool, broadcastable to [batch, beam, vocab]: the tokens that may come next.
    k: how many.
    disallowed: the log-probability of a token not allowed.

  Returns:
    (log-probabilities [batch, k] of the hypotheses extended, descending, disallowed tokens at
    live + `disallowed`; their beams [batch, k]; their tokens [batch, k]), in lax.top_k's order,
    ties to the lower beam then token, but for log-probabilities that round equal from unequal
    logits.
  """
  batch, beam = live_log_probs.shape
  logits = logits.reshape(batch, beam, -1)
  vocab = logits.shape[-1]
  # log_softmax's own arithmetic (jax.nn.log_softmax), for the k best only.
  row_max = logits.max(-1, keepdims=True)
  log_sum = jnp.log(jnp.exp(logits - row_max).sum(-1, keepdims=True))
  ranked = jnp.where(allowed, logits, -jnp.inf)
  row_k = min(k, vocab)
  values, tokens = top_k(ranked.reshape(batch * beam, vocab), row_k)
  values, tokens = values.reshape(batch, beam, row_k), tokens.reshape(batch, beam, row_k)
  log_probs = jnp.where(values > -jnp.inf, (values - row_max) - log_sum, disallowed)
  best, position = jax.lax.top_k((live_log_probs[:, :, None] + log_probs).reshape(batch, -1), k)
  token = jnp.take_along_axis(tokens.reshape(batch, -1), position, axis=1)
  return best, position // row_k, token
