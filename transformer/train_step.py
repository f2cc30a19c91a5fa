"""The data-parallel training and evaluation steps, to be run under `jax.pmap`.

Each device computes sums over its own real (non-pad) target tokens; the sums are combined over
the device axis and, with gradient accumulation, over micro-batches, and only then divided by the
global token count, so an update is the same however the global batch is split.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from flax import jax_utils
from flax.training import train_state

from transformer import config as config_lib
from transformer import hash_rng, loss, optim
from transformer.model import Transformer, TransformerConfig, output_table

AXIS = 'batch'  # the pmapped device axis
TrainState = train_state.TrainState


def _global_norm(tree):
  """The L2 norm of all of `tree`'s arrays as one vector. XLA reads them in a few kernels, where
  optax.tree.norm's sum per array is a kernel each: compiled for an H100, 92 fewer kernels in the
  Multi30k recipe's step of 461 (benchmarks.gpu_plan)."""
  return jnp.linalg.norm(jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(tree)]))


def replicate(tree):
  """`tree` copied to every local device, sharded over a mesh axis named AXIS as the pmapped steps'
  outputs are. With flax's default axis name the first step's inputs are sharded otherwise than
  the next step's, and the step is traced and compiled twice."""
  return jax_utils.replicate(tree, axis_name=AXIS)


def initial_state(config: ml_collections.ConfigDict, model_config: TransformerConfig) -> TrainState:
  """Parameters initialised from config.seed, and the optimizer's state, in the host's memory.

  Made on the host's CPU (`replicate` copies it to the devices): a GPU spends seconds
  compiling the initialisers, a CPU a fraction of that.
  """
  model = Transformer(model_config)
  init_model = Transformer(model_config.replace(attention_implementation='xla'))  # runs anywhere
  with jax.default_device(jax.local_devices(backend='cpu')[0]):
    tokens = jnp.ones((1, 1), jnp.int32)
    params = jax.jit(init_model.init)(jax.random.key(config.seed), tokens, tokens)['params']
    return TrainState.create(apply_fn=model.apply, params=params, tx=optim.optimizer(config))


def _batch_sums(params, batch, model: nn.Module, label_smoothing, chunk, online, rngs=None):
  states = model.apply({'params': params}, **batch, project=False, rngs=rngs)
  sums = loss.projected_token_sums(states, output_table(params), batch['targets'],
                                   label_smoothing, chunk, online)
  sums['source_tokens'] = (batch['sources'] > 0).sum().astype(jnp.float32)
  return sums


class StepFunctions:
  """The per-device step functions of one experiment; wrap each in `jax.pmap(..., AXIS)`."""

  def __init__(self, config: ml_collections.ConfigDict, model_config: TransformerConfig):
    self.train_model = Transformer(model_config.replace(deterministic=False))
    self.eval_model = Transformer(model_config.replace(deterministic=True))
    self.label_smoothing = config.label_smoothing
    self.loss_chunk = config_lib.loss_chunk(config)
    self.online_loss = config_lib.online_loss(config)
    self.schedule = optim.learning_rate(config)
    self.seed = config.seed
    self.rng_impl = hash_rng.IMPL if config.dropout_rng_impl == 'hash' else config.dropout_rng_impl

  def gradients(self, state: TrainState, batch, micro_step):
    """Gradients of the loss sum and the token sums of one micro-batch on this device."""
    # Dropout differs per step, micro-batch and device, and follows from the seed alone.
    rng = jax.random.fold_in(jax.random.key(self.seed, impl=self.rng_impl), state.step)
    rng = jax.random.fold_in(jax.random.fold_in(rng, micro_step), jax.lax.axis_index(AXIS))

    def loss_sum(params):
      sums = _batch_sums(params, batch, self.train_model, self.label_smoothing, self.loss_chunk,
                         self.online_loss, {'dropout': rng})
      return sums['loss'], sums

    grads, sums = jax.grad(loss_sum, has_aux=True)(state.params)
    return grads, sums

  def accumulate(self, state: TrainState, batch, micro_step, accumulated):
    """Adds one more micro-batch to the (gradient, sums) accumulated so far."""
    return jax.tree_util.tree_map(jnp.add, accumulated, self.gradients(state, batch, micro_step))

  def apply_gradients(self, state: TrainState, grads, sums):
    """Combines sums over devices, normalises by the global target token count and updates.

    A non-finite loss or gradient leaves the state unchanged and reports `finite` = 0.
    """
    grads, sums = jax.lax.psum((grads, sums), AXIS)
    tokens = jnp.maximum(sums['tokens'], 1.0)
    grad_norm = _global_norm(grads) / tokens
    grads = jax.tree_util.tree_map(lambda g: g / tokens, grads)
    finite = jnp.isfinite(sums['loss']) & jnp.isfinite(grad_norm)
    updated = state.apply_gradients(grads=grads)
    new_state = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old), updated,
                                       state)
    metrics = dict(sums, grad_norm=grad_norm, learning_rate=self.schedule(state.step + 1),
                   finite=finite.astype(jnp.float32))
    return new_state, metrics

  def train_step(self, state: TrainState, batch):
    """One update from one micro-batch per device (no accumulation)."""
    return self.apply_gradients(state, *self.gradients(state, batch, 0))

  def eval_step(self, params, batch):
    """Token sums over the global batch, without dropout."""
    return jax.lax.psum(_batch_sums(params, batch, self.eval_model, self.label_smoothing,
                                    self.loss_chunk, self.online_loss), AXIS)
