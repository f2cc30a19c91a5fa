"""The data-parallel training and evaluation steps, to be run under `jax.pmap`.

Each device computes sums over its own real (non-pad) target tokens; the sums are combined over
the device axis and, with gradient accumulation, over micro-batches, and only then divided by the
global token count, so an update is the same however the global batch is split.

The steps take the state packed (`kernels.packing.pack_state`): the parameters and Adam's moments
as one vector per dtype, so that a call passes a few arrays instead of hundreds.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import jax_utils
from flax.training import train_state

from transformer import config as config_lib
from transformer import loss, marian, optim
from transformer.kernels import hash_rng, packing
from transformer.kernels import loss as kernel_loss
from transformer.kernels.choice import Implementations
from transformer.model import Transformer, output_table

AXIS = 'batch'  # the pmapped device axis
TrainState = train_state.TrainState


def replicate(tree):
  """`tree` copied to every local device, sharded over a mesh axis named AXIS as the pmapped steps'
  outputs are. With flax's default axis name the first step's inputs are sharded otherwise than
  the next step's, and the step is traced and compiled twice."""
  return jax_utils.replicate(tree, axis_name=AXIS)


def _initial_params(config: ml_collections.ConfigDict) -> dict:
  tokens = jnp.ones((1, 1), jnp.int32)
  return Transformer(config_lib.model_config(config)).init(jax.random.key(config.seed), tokens,
                                                           tokens)['params']


def initial_state(config: ml_collections.ConfigDict) -> TrainState:
  """Parameters initialised from config.seed (or config.init_from's), and the optimizer's state,
  in the host's memory, as trees (`packing.pack_state` packs them for the steps).

  Made on the host's CPU (`replicate` copies it to the devices): a GPU spends seconds
  compiling the initialisers, a CPU a fraction of that.
  """
  with jax.default_device(jax.local_devices(backend='cpu')[0]):
    if config.init_from:  # a Marian model's weights, in our token order
      params = jax.tree_util.tree_map(jnp.asarray, marian.import_params(
          config.init_from, config_lib.model_config(config)))
    else:
      params = jax.jit(functools.partial(_initial_params, config))()
    return TrainState.create(apply_fn=None, params=params, tx=optim.optimizer(config))


def _batch_sums(params, batch, model: nn.Module, label_smoothing: float,
                implementations: Implementations, rngs=None) -> dict:
  """The loss's sums over one batch (`loss.token_sums`), and its real source tokens."""
  chunk, reduction = implementations.loss_chunk, implementations.loss_reduction
  # The loss kernels project without a bias: a model with one (an imported Marian) takes the
  # plain form.
  if chunk is None and reduction == 'separate' or 'output_bias' in params:
    logits = model.apply({'params': params}, **batch, rngs=rngs)
    sums = loss.token_sums(logits, batch['targets'], label_smoothing)
  else:  # transformer/kernels/loss.py: the logits a chunk at a time, or read once
    states = model.apply({'params': params}, **batch, project=False, rngs=rngs)
    sums = kernel_loss.projected_token_sums(states, output_table(params), batch['targets'],
                                            label_smoothing, chunk, reduction)
  sums['source_tokens'] = (batch['sources'] > 0).sum().astype(jnp.float32)
  return sums


class StepFunctions:
  """The per-device step functions of one experiment; wrap each in `jax.pmap(..., AXIS)`. They
  take the state, or its parameters, packed (`packing.pack_state`)."""

  def __init__(self, config: ml_collections.ConfigDict, implementations: Implementations):
    model_config = config_lib.model_config(config, implementations)
    self.train_model = Transformer(model_config.replace(deterministic=False))
    self.eval_model = Transformer(model_config.replace(deterministic=True))
    self.label_smoothing = config.label_smoothing
    self.implementations = implementations
    self.schedule = optim.learning_rate(config)
    self.seed = config.seed
    rng = config.implementation.dropout_rng
    self.rng_impl = hash_rng.IMPL if rng == 'hash' else rng
    self.param_shapes = jax.eval_shape(functools.partial(_initial_params, config))

  def params_tree(self, packed_params) -> dict:
    """The parameters' tree of a packed state's `params` (on the host, views of its vectors)."""
    return packing.unpack(packed_params, self.param_shapes)

  def gradients(self, state: TrainState, batch, micro_step):
    """Gradients of the loss sum, packed as the parameters, and the token sums of one micro-batch
    on this device."""
    # Dropout differs per step, micro-batch and device, and follows from the seed alone.
    rng = jax.random.fold_in(jax.random.key(self.seed, impl=self.rng_impl), state.step)
    rng = jax.random.fold_in(jax.random.fold_in(rng, micro_step), jax.lax.axis_index(AXIS))

    def loss_sum(params):
      sums = _batch_sums(params, batch, self.train_model, self.label_smoothing,
                         self.implementations, {'dropout': rng})
      return sums['loss'], sums

    grads, sums = jax.grad(loss_sum, has_aux=True)(self.params_tree(state.params))
    return packing.pack(grads, jnp), sums

  def accumulate(self, state: TrainState, batch, micro_step, accumulated):
    """Adds one more micro-batch to the (gradient, sums) accumulated so far."""
    return jax.tree_util.tree_map(jnp.add, accumulated, self.gradients(state, batch, micro_step))

  def apply_gradients(self, state: TrainState, grads, sums):
    """Combines sums over devices, normalises by the global target token count and updates.

    A non-finite loss or gradient leaves the state unchanged and reports `finite` = 0.
    """
    if jax.lax.axis_size(AXIS) > 1:  # over one device a copy, which XLA keeps on a CPU
      grads, sums = jax.lax.psum((grads, sums), AXIS)
    tokens = jnp.maximum(sums['tokens'], 1.0)
    grad_norm = optax.tree.norm(grads) / tokens
    finite = jnp.isfinite(sums['loss']) & jnp.isfinite(grad_norm)
    # A branch, not a select between the updated and the old state: a select keeps both alive,
    # and XLA copies the donated moments and computes Adam's update twice (docs/speed.md).
    normalised = lambda: jax.tree_util.tree_map(lambda g: g / tokens, grads)
    new_state = jax.lax.cond(finite, lambda: state.apply_gradients(grads=normalised()),
                             lambda: state)
    metrics = dict(sums, grad_norm=grad_norm, learning_rate=self.schedule(state.step + 1),
                   finite=finite.astype(jnp.float32))
    return new_state, metrics

  def train_step(self, state: TrainState, batch):
    """One update from one micro-batch per device (no accumulation)."""
    return self.apply_gradients(state, *self.gradients(state, batch, 0))

  def eval_step(self, params, batch):
    """Token sums over the global batch at a packed state's `params`, without dropout."""
    sums = _batch_sums(self.params_tree(params), batch, self.eval_model, self.label_smoothing,
                       self.implementations)
    return jax.lax.psum(sums, AXIS)
