"""The loss's sums (`transformer.loss.token_sums`) computed faster, from the decoder's output.

`projected_token_sums` never holds more than [chunk, vocab] logits and skips chunks of padding:
real target positions are moved to the front, and the chunks past them are not projected. Its
gradient is computed chunk by chunk in the forward pass (a `jax.custom_vjp`), so the backward pass
holds no logits either. `online_token_sums` gives the sums in one read of the logits, where
`token_sums` reads them once per statistic (the max, then each sum).
"""

import functools

import jax
import jax.numpy as jnp

from transformer.loss import token_sums
from transformer.model import project

SUMS = ('loss', 'nll', 'correct', 'tokens')


def _row_statistics(logits, targets):
  """(max, sum of exp(logit - max), reference logit, sum) over the last axis, in one pass: a
  variadic reduction that rescales its running exp-sum when the running max grows (the online
  softmax of Milakov and Gimelshein, 2018)."""
  vocab_ids = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
  reference = jnp.where(vocab_ids == targets[..., None], logits, 0.0)

  def combine(a, b):
    (max_a, exp_a, ref_a, sum_a), (max_b, exp_b, ref_b, sum_b) = a, b
    gap = max_b - max_a
    shrink = jnp.exp(-jnp.abs(gap))  # one exponential: the smaller max's sum is scaled down
    exp_sum = jnp.where(gap <= 0, exp_a + exp_b * shrink, exp_a * shrink + exp_b)
    return jnp.maximum(max_a, max_b), exp_sum, ref_a + ref_b, sum_a + sum_b

  dtype = logits.dtype
  # The running max starts finite, so two empty operands combine to a gap of 0, not NaN.
  start = (jnp.finfo(dtype).min, 0, 0, 0)
  return jax.lax.reduce((logits, jnp.ones_like(logits), reference, logits),
                        tuple(jnp.asarray(x, dtype) for x in start), combine, (logits.ndim - 1,))


def _online_sums(logits, targets, label_smoothing):
  row_max, exp_sum, target_logits, logit_sum = _row_statistics(logits, targets)
  log_normalizer = row_max + jnp.log(exp_sum)
  weights = (targets > 0).astype(jnp.float32)
  nll = log_normalizer - target_logits
  smoothing = log_normalizer - logit_sum / logits.shape[-1]
  loss = (1.0 - label_smoothing) * nll + label_smoothing * smoothing
  correct = (target_logits >= row_max).astype(jnp.float32)
  sums = {'loss': (loss * weights).sum(), 'nll': (nll * weights).sum(),
          'correct': (correct * weights).sum(), 'tokens': weights.sum()}
  return sums, (logits, targets, log_normalizer, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def online_token_sums(logits, targets, label_smoothing: float) -> dict:
  """`token_sums` from one read of the logits (the module's docstring says when it is faster).

  Its gradient is written out (autodiff has no rule for a reduction with its own combiner): one
  elementwise pass over the logits, as autodiff of `token_sums` makes.
  """
  return _online_sums(logits, targets, label_smoothing)[0]


def _online_sums_backward(label_smoothing, residuals, cotangents):
  logits, targets, log_normalizer, weights = residuals
  # d loss / d logits = softmax - (1 - eps) one_hot - eps / vocab; d nll = softmax - one_hot.
  loss_scale, nll_scale = cotangents['loss'] * weights, cotangents['nll'] * weights
  softmax = jnp.exp(logits - log_normalizer[..., None])
  vocab_ids = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
  at_target = vocab_ids == targets[..., None]
  grad = ((loss_scale + nll_scale)[..., None] * softmax -
          jnp.where(at_target, ((1.0 - label_smoothing) * loss_scale + nll_scale)[..., None], 0.0)
          - (label_smoothing / logits.shape[-1]) * loss_scale[..., None])
  return grad.astype(logits.dtype), None


online_token_sums.defvjp(lambda logits, targets, label_smoothing: _online_sums(
    logits, targets, label_smoothing), _online_sums_backward)


def _chunk_sums(states, table, targets, label_smoothing, online):
  sums_of = online_token_sums if online else token_sums
  sums = sums_of(project(states, table), targets, label_smoothing)
  return sums['loss'], sums


def _chunked(states, table, targets, label_smoothing, chunk, online, with_grads):
  """(sums, d loss / d states, d loss / d table) over [tokens, d_model] states, chunk by chunk;
  the gradients are None unless `with_grads`."""
  size, width = states.shape
  targets = jnp.pad(targets, (0, -size % chunk))  # whole chunks; rows past `size` read as zeros
  order = jnp.argsort(targets == 0, stable=True)  # real target positions first
  real = (targets > 0).sum()
  chunks = targets.size // chunk
  xs = (jnp.arange(chunks),
        jnp.take(states, order, axis=0, mode='fill', fill_value=0).reshape(chunks, chunk, width),
        targets[order].reshape(chunks, chunk))
  zeros = {name: jnp.zeros((), jnp.float32) for name in SUMS}
  sums_and_grads = jax.value_and_grad(_chunk_sums, argnums=(0, 1), has_aux=True)

  def step(carry, x):
    index, chunk_states, chunk_targets = x

    def work(carry):
      sums, table_grad = carry
      if with_grads:
        (_, chunk), (states_grad, chunk_table_grad) = sums_and_grads(
            chunk_states, table, chunk_targets, label_smoothing, online)
        table_grad = table_grad + chunk_table_grad
      else:
        _, chunk = _chunk_sums(chunk_states, table, chunk_targets, label_smoothing, online)
        states_grad = None
      return (jax.tree_util.tree_map(jnp.add, sums, chunk), table_grad), states_grad

    def skip(carry):  # only padding from here on
      return carry, jnp.zeros_like(chunk_states) if with_grads else None

    return jax.lax.cond(index * chunk < real, work, skip, carry)

  table_grad = jnp.zeros_like(table) if with_grads else None
  (sums, table_grad), states_grad = jax.lax.scan(step, (zeros, table_grad), xs)
  if with_grads:
    states_grad = states_grad.reshape(-1, width)[jnp.argsort(order)][:size]
  return sums, states_grad, table_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _sums(states, table, targets, label_smoothing, chunk, online):
  return _chunked(states, table, targets, label_smoothing, chunk, online, False)[0]


def _sums_forward(states, table, targets, label_smoothing, chunk, online):
  sums, states_grad, table_grad = _chunked(states, table, targets, label_smoothing, chunk, online,
                                           True)
  return sums, (states_grad, table_grad)


def _sums_backward(label_smoothing, chunk, online, grads, cotangents):
  del label_smoothing, chunk, online
  scale = cotangents['loss']  # the other sums leave projected_token_sums without a gradient
  states_grad, table_grad = (grad * scale.astype(grad.dtype) for grad in grads)
  return states_grad, table_grad, None


_sums.defvjp(_sums_forward, _sums_backward)


def projected_token_sums(states, table, targets, label_smoothing: float, chunk: int | None,
                         reduction: str = 'separate') -> dict:
  """`token_sums(model.project(states, table), targets, label_smoothing)`, `chunk` target
  positions at a time. states [..., d_model], table [vocab, d_model], targets [...] (0 = padding).
  Only 'loss' carries a gradient. With `chunk` None or at least the number of positions, the
  logits are projected at once, without the chunk loop (whose steps run one after another).
  `reduction`: 'separate' (`token_sums`) or 'online' (`online_token_sums`)."""
  width = states.shape[-1]
  states, targets = states.reshape(-1, width), targets.reshape(-1)
  online = reduction == 'online'
  if chunk is None or chunk >= targets.size:
    sums_of = online_token_sums if online else token_sums
    sums = sums_of(project(states, table), targets, label_smoothing)
  else:
    sums = _sums(states, table, targets, label_smoothing, chunk, online)
  return {name: value if name == 'loss' else jax.lax.stop_gradient(value)
          for name, value in sums.items()}
