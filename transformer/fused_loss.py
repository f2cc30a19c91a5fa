"""The label-smoothed cross-entropy's row statistics and its gradient over the logits, in one
Pallas kernel that reads each row of float32 logits once.

XLA's fastest loss on a GPU (`loss.online_token_sums`) reads the [tokens, vocab] logits twice: once
forward for the row statistics, and once backward, where the gradient needs the log-normaliser
first. Here one program reads a row for its statistics, then again, most of it from the L2 cache
while the row is fresh (the rows being read fit it: CHUNK), for its gradient for a loss cotangent of
1, written in the compute dtype for the two backward matmuls. At the paper's base size the logits
are ~1.5 GB a step, so the read saved is ~0.45 ms of an H100's memory time. The gradient is the
loss's only one (`loss.projected_token_sums`), so the backward pass scales the matmuls' products by
the cotangent instead of the [tokens, vocab] gradient. No library computes a cross-entropy's
gradient in its forward pass on GPUs (tokamax's is TPU-only), hence this kernel.

Written on Pallas's Triton lowering (see transformer/fused_norm.py); elsewhere the kernel runs in
Pallas's interpreter, slowly, for tests.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
# Columns a program holds at a time (Triton's blocks are powers of 2), and its warps: 16 of a
# chunk's logits a thread. The second read of a row hits the L2 cache only while the rows being
# read fit it: with 2048 columns and 4 warps (56 registers) an H100's SM held 9 programs, 1,188
# rows of 64 KB at stage base_train's vocabulary of 16000, 76 MB against 50 MB of L2; with 8192
# and 16 warps (64 registers; about as many warps an SM), 2: 17 MB, 39 MB at 37000
# (`python -m benchmarks.gpu_plan`'s Triton table, gpu_plan_kernels.md).
CHUNK = 8192
WARPS = 16


def _loss_kernel(logits_ref, targets_ref, loss_ref, nll_ref, correct_ref, grad_ref, *,
                 vocab: int, label_smoothing: float):
  """One row: its statistics over the chunks of its columns, then its gradient chunk by chunk."""
  target = targets_ref[...]
  weight = (target > 0).astype(jnp.float32)

  def chunk(index):
    """(columns, their logits, in the vocabulary), -inf past its end."""
    column = index * CHUNK + jax.lax.broadcasted_iota(jnp.int32, (1, CHUNK), 1)
    inside = column < vocab
    logits = plgpu.load(logits_ref.at[:, pl.ds(index * CHUNK, CHUNK)], mask=inside,
                        other=-jnp.inf)
    return column, logits, inside

  def statistics(index, running):
    """The online softmax (Milakov and Gimelshein, 2018), with the target logit and the sum."""
    row_max, exp_sum, target_logit, logit_sum = running
    column, logits, inside = chunk(index)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    exp_sum = (exp_sum * jnp.exp(row_max - new_max) +
               jnp.sum(jnp.exp(logits - new_max[:, None]), axis=1))
    target_logit += jnp.sum(jnp.where(column == target[:, None], logits, 0.0), axis=1)
    logit_sum += jnp.sum(jnp.where(inside, logits, 0.0), axis=1)
    return new_max, exp_sum, target_logit, logit_sum

  chunks = pl.cdiv(vocab, CHUNK)
  zero = jnp.zeros_like(weight)
  row_max, exp_sum, target_logit, logit_sum = jax.lax.fori_loop(
      0, chunks, statistics, (zero - jnp.inf, zero, zero, zero))
  log_normalizer = row_max + jnp.log(exp_sum)
  nll = log_normalizer - target_logit
  loss = (1.0 - label_smoothing) * nll + label_smoothing * (log_normalizer - logit_sum / vocab)
  loss_ref[...] = loss * weight
  nll_ref[...] = nll * weight
  correct_ref[...] = (target_logit >= row_max).astype(jnp.float32) * weight

  def gradient(index, carry):
    # As loss._online_sums_backward writes it, for a loss cotangent of 1 and none on nll.
    column, logits, inside = chunk(index)
    grad = weight[:, None] * (jnp.exp(logits - log_normalizer[:, None]) -
                              jnp.where(column == target[:, None], 1.0 - label_smoothing, 0.0) -
                              label_smoothing / vocab)
    plgpu.store(grad_ref.at[:, pl.ds(index * CHUNK, CHUNK)], grad.astype(grad_ref.dtype),
                mask=inside)
    return carry

  jax.lax.fori_loop(0, chunks, gradient, 0)


def sums_and_gradient(logits: Array, targets: Array, label_smoothing: float, grad_dtype):
  """Per-token sums and the loss's gradient over the logits.

  Args:
    logits: [tokens, vocab] float32.
    targets: [tokens] reference ids, 0 = padding.
    label_smoothing: eps of `loss.token_sums`.
    grad_dtype: the gradient's dtype.

  Returns:
    (each token's smoothed loss, nll and correctness [tokens] float32, 0 at padding;
    [tokens, vocab] d (summed loss) / d logits in grad_dtype).
  """
  tokens, vocab = logits.shape
  row = pl.BlockSpec((1, pl.cdiv(vocab, CHUNK) * CHUNK), lambda i: (i, 0))
  token = pl.BlockSpec((1,), lambda i: (i,))
  *sums, grad = pl.pallas_call(
      functools.partial(_loss_kernel, vocab=vocab, label_smoothing=label_smoothing),
      grid=(tokens,),
      in_specs=[row, token],
      out_specs=[token, token, token, row],
      out_shape=[jax.ShapeDtypeStruct((tokens,), jnp.float32)] * 3 + [
          jax.ShapeDtypeStruct((tokens, vocab), grad_dtype)],
      compiler_params=plgpu.CompilerParams(num_warps=WARPS),
      interpret=jax.default_backend() != 'gpu')(logits, targets.astype(jnp.int32))
  return sums, grad
