"""Learning-rate schedules and the Adam optimizer of section 5.3."""

import jax.numpy as jnp
import ml_collections
import optax


def learning_rate(config: ml_collections.ConfigDict):
  """lr(step) for 1-based update steps, as the paper numbers them.

  'paper':         lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
  'warmup_rsqrt':  peak_learning_rate * min(step / warmup, (warmup / step)^0.5), the same shape
                   with the peak given directly.

  With config.cooldown_steps = C > 0 (not in the paper), the last C of num_train_steps = T steps
  take it down linearly towards 0: times min(1, (T + 1 - step) / C), so step T updates at 1/C of
  the schedule.
  """
  warmup, cooldown = config.warmup_steps, config.cooldown_steps
  if config.schedule == 'paper':
    scale = config.lr_scale * config.model.d_model**-0.5 * warmup**-0.5
  else:
    scale = config.peak_learning_rate

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    lr = scale * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))
    if cooldown:
      lr *= jnp.clip((config.num_train_steps + 1 - step) / cooldown, 0.0, 1.0)
    return lr

  return schedule


def optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam with the schedule (optax counts updates from 0, the paper from 1)."""
  schedule = learning_rate(config)
  adam = optax.adam(lambda count: schedule(count + 1), b1=config.adam_b1, b2=config.adam_b2,
                    eps=config.adam_eps)
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)
  return adam
