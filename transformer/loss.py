"""The label-smoothed cross-entropy of section 5.4, summed over real (non-pad) target tokens.

The train step divides the sums by the global batch's target tokens (transformer/train_step.py).
`kernels/loss.py` computes the same sums from the decoder's output without holding the whole
batch's logits, or in one read of them.
"""

import jax
import jax.numpy as jnp


def token_sums(logits, targets, label_smoothing: float) -> dict:
  """Sums over real target tokens: label-smoothed loss, NLL, correct predictions and their count.

  Smoothing puts (1 - eps) on the reference token and eps spread evenly over the vocabulary
  (Szegedy et al., as cited in section 5.4); its cross-entropy is written as
  (1 - eps) * nll + eps * (logsumexp - mean logit), which avoids a [tokens, vocab] one-hot.
  """
  weights = (targets > 0).astype(jnp.float32)
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)
  # A compare-select: its gradient is elementwise and fuses with the softmax's, where
  # take_along_axis's is a scatter into a [tokens, vocab] buffer, one more pass over the logits.
  vocab_ids = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
  target_logits = jnp.where(vocab_ids == targets[..., None], logits, 0.0).sum(axis=-1)
  nll = log_normalizer - target_logits
  smoothing = log_normalizer - logits.mean(axis=-1)
  loss = (1.0 - label_smoothing) * nll + label_smoothing * smoothing
  # The reference has the largest logit: a max (logsumexp takes one anyway) costs less than argmax.
  correct = (target_logits >= logits.max(axis=-1)).astype(jnp.float32)
  return {
      'loss': (loss * weights).sum(),
      'nll': (nll * weights).sum(),
      'correct': (correct * weights).sum(),
      'tokens': weights.sum(),
  }
