"""Schedule, loss and the data-parallel step: the same update however the batch is split."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils

from configs import default, tiny
from transformer import config as config_lib
from transformer import optim, train_step
from transformer.kernels import choice, packing
from transformer.kernels.choice import Implementations
from transformer.checkpoints import local_copy


@pytest.mark.parametrize('step', [1, 2000, 4000, 16000, 100_000])
def test_paper_schedule_equals_the_formula(step):
  config = default.get_config()
  expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
  got = float(optim.learning_rate(config)(step))
  assert abs(got - expected) / expected <= 1e-6


def test_warmup_rsqrt_schedule_peaks_at_the_given_value():
  config = default.get_config()
  config.schedule, config.peak_learning_rate = 'warmup_rsqrt', 1e-3
  schedule = optim.learning_rate(config)
  np.testing.assert_allclose([float(schedule(s)) for s in (400, 4000, 16000)],
                             [1e-4, 1e-3, 5e-4], rtol=1e-6)


def test_cooldown_takes_the_last_steps_linearly_down_to_zero():
  config = default.get_config()
  config.update(num_train_steps=10000, cooldown_steps=2000)
  schedule = optim.learning_rate(config)
  def paper(step):
    return 512**-0.5 * min(step**-0.5, step * 4000**-1.5)

  steps = [4000, 8000, 8001, 9000, 10000]  # before it (2), its first, about halfway, the last
  np.testing.assert_allclose([float(schedule(s)) for s in steps],
                             [paper(4000), paper(8000), paper(8001), paper(9000) * 1001 / 2000,
                              paper(10000) / 2000], rtol=1e-6)
  config.cooldown_steps = 10001
  with pytest.raises(config_lib.ConfigError, match='cooldown_steps=10001: the cooldown is part of '
                     'config.num_train_steps=10000'):
    config_lib.validate(config)


def test_first_update_uses_the_step_1_learning_rate():
  config = default.get_config()
  tx = optim.optimizer(config)
  params = {'w': jnp.zeros(3)}
  updates, _ = tx.update({'w': jnp.array([0.5, -2.0, 1.0])}, tx.init(params), params)
  # Adam's first step moves each weight by lr * sign(g) (bias-corrected moments, tiny eps).
  np.testing.assert_allclose(updates['w'], -512**-0.5 * 4000**-1.5 * np.array([1, -1, 1]),
                             rtol=1e-5)


@pytest.mark.parametrize('clip', [0.0, 0.01])
def test_gradient_clipping_is_applied_when_configured(clip):
  config = default.get_config()
  config.grad_clip_norm, config.adam_eps = clip, 1.0  # a large eps makes Adam scale-sensitive
  tx = optim.optimizer(config)
  params, grads = {'w': jnp.zeros(2)}, {'w': jnp.array([3.0, 4.0])}  # norm 5
  updates, _ = tx.update(grads, tx.init(params), params)
  g = grads['w'] * (clip / 5.0 if clip else 1.0)
  lr = 512**-0.5 * 4000**-1.5
  np.testing.assert_allclose(updates['w'], -lr * g / (jnp.abs(g) + 1.0), rtol=1e-5)


def _setup():
  config = tiny.get_config()
  config.model.update(dropout_rate=0.0)  # so that the split cannot change random masks
  # Adam's first step is lr * g / (|g| + eps): with the paper's eps it is lr * sign(g), blind to
  # how g was summed and normalised. With eps = 10 it is about lr * g / 10, so the parameters
  # show any difference in the gradients.
  config.adam_eps = 10.0
  config.lr_scale = 10.0  # updates well above the float32 spacing of the weights
  config_lib.validate(config)
  implementations = choice.for_this_machine(config)
  state = packing.pack_state(train_step.initial_state(config))
  # Eight rows of different lengths: each device sees a different number of real tokens.
  rng = np.random.default_rng(0)
  lengths = [3, 9, 5, 12, 1, 7, 10, 4]
  sources = np.zeros((8, 12), np.int32)
  targets = np.zeros((8, 12), np.int32)
  for row, n in enumerate(lengths):
    sources[row, :n] = rng.integers(3, config.vocab_size, n)
    targets[row, :13 - n] = rng.integers(3, config.vocab_size, 13 - n)
  return config, implementations, state, {'sources': sources, 'targets': targets}


def _update(steps, state, batch, devices, grad_accum=1):
  """One update with the batch split over `devices` and then over `grad_accum` micro-batches."""
  n = len(devices)
  micro = [{k: v.reshape(n, grad_accum, -1, v.shape[-1])[:, i] for k, v in batch.items()}
           for i in range(grad_accum)]
  state = jax_utils.replicate(state, devices)
  if grad_accum == 1:
    new_state, metrics = jax.pmap(steps.train_step, train_step.AXIS, devices=devices)(state,
                                                                                       micro[0])
  else:
    index = lambda i: np.full(n, i, np.int32)
    acc = jax.pmap(steps.gradients, train_step.AXIS, devices=devices)(state, micro[0], index(0))
    for i in range(1, grad_accum):
      acc = jax.pmap(steps.accumulate, train_step.AXIS, devices=devices)(state, micro[i],
                                                                         index(i), acc)
    new_state, metrics = jax.pmap(steps.apply_gradients, train_step.AXIS, devices=devices)(
        state, *acc)
  return local_copy(new_state), local_copy(metrics)


def _max_difference(a, b):
  return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                          jax.tree_util.tree_leaves(b)))


@pytest.mark.slow
def test_one_device_and_four_devices_make_the_same_update():
  assert jax.local_device_count() >= 4, 'tests/conftest.py asks XLA for 4 CPU devices'
  config, implementations, state, batch = _setup()
  steps = train_step.StepFunctions(config, implementations)
  one, metrics_one = _update(steps, state, batch, jax.local_devices()[:1])
  four, metrics_four = _update(steps, state, batch, jax.local_devices()[:4])
  assert metrics_one['tokens'] == metrics_four['tokens'] == 53  # 13 * 8 - sum(lengths)
  np.testing.assert_allclose(metrics_one['loss'], metrics_four['loss'], rtol=1e-6)
  update = _max_difference(state.params, one.params)
  assert update > 1e-5
  # Same sums in another order: float32 rounding only (the parameters' own ulp is 3e-8).
  assert _max_difference(one.params, four.params) < 1e-3 * update


@pytest.mark.slow
@pytest.mark.parametrize('reduction,chunk', [('separate', 16), ('online', None), ('online', 16)])
def test_each_loss_reduction_makes_the_update_of_the_models_logits(reduction, chunk):
  """How the loss reads the logits (transformer/kernels/loss.py) changes nothing in the step's
  result: the chunks of a CPU, and 'online' with the whole batch at once, as on a GPU, or in
  chunks, give the update of `loss.token_sums` on the model's logits."""
  config, _, state, batch = _setup()
  plain = Implementations(loss_chunk=None, loss_reduction='separate')
  separate, metrics = _update(train_step.StepFunctions(config, plain), state, batch,
                              jax.local_devices()[:1])
  update = _max_difference(state.params, separate.params)
  faster = Implementations(loss_chunk=chunk, loss_reduction=reduction)
  other, other_metrics = _update(train_step.StepFunctions(config, faster), state, batch,
                                 jax.local_devices()[:1])
  for name in ('loss', 'nll', 'correct', 'tokens'):
    np.testing.assert_allclose(other_metrics[name], metrics[name], rtol=1e-6, err_msg=name)
  # Adam's step hardly depends on the gradient's scale; its norm does.
  np.testing.assert_allclose(other_metrics['grad_norm'], metrics['grad_norm'], rtol=1e-5)
  assert _max_difference(separate.params, other.params) < 1e-3 * update


@pytest.mark.slow
def test_gradient_accumulation_equals_the_doubled_batch():
  config, implementations, state, batch = _setup()
  steps = train_step.StepFunctions(config, implementations)
  whole, _ = _update(steps, state, batch, jax.local_devices()[:1])
  accumulated, metrics = _update(steps, state, batch, jax.local_devices()[:1], grad_accum=2)
  assert metrics['tokens'] == 53
  update = _max_difference(state.params, whole.params)
  assert _max_difference(whole.params, accumulated.params) < 1e-3 * update
  # and on four devices with two micro-batches each
  spread, _ = _update(steps, state, batch, jax.local_devices()[:4], grad_accum=2)
  assert _max_difference(whole.params, spread.params) < 1e-3 * update


@pytest.mark.slow
def test_a_non_finite_gradient_leaves_the_state_unchanged():
  config, implementations, state, batch = _setup()
  steps = train_step.StepFunctions(config, implementations)
  state = jax_utils.replicate(state, jax.local_devices()[:1])
  grads, sums = jax.pmap(steps.gradients, train_step.AXIS, devices=jax.local_devices()[:1])(
      state, {k: v[None] for k, v in batch.items()}, np.zeros(1, np.int32))
  grads = jax.tree_util.tree_map(lambda g: g.at[:].set(jnp.nan), grads)
  new_state, metrics = jax.pmap(steps.apply_gradients, train_step.AXIS,
                                devices=jax.local_devices()[:1])(state, grads, sums)
  assert float(metrics['finite'][0]) == 0.0
  assert _max_difference(state.params, new_state.params) == 0.0
  assert int(new_state.step[0]) == 0


@pytest.mark.slow
def test_the_reported_gradient_norm_is_the_norm_of_the_normalised_gradients():
  """The step takes the norm of the packed gradients, divided by the token count after: optax's
  norm of the per-token gradients, array by array, to float32 rounding."""
  config, implementations, state, batch = _setup()
  steps = train_step.StepFunctions(config, implementations)
  state = jax_utils.replicate(state, jax.local_devices()[:1])
  grads, sums = jax.pmap(steps.gradients, train_step.AXIS, devices=jax.local_devices()[:1])(
      state, {k: v[None] for k, v in batch.items()}, np.zeros(1, np.int32))
  _, metrics = jax.pmap(steps.apply_gradients, train_step.AXIS,
                        devices=jax.local_devices()[:1])(state, grads, sums)
  per_token = steps.params_tree(jax.tree_util.tree_map(lambda g: g[0] / float(sums['tokens'][0]),
                                                       grads))
  assert len(jax.tree_util.tree_leaves(per_token)) > 10
  assert float(sums['tokens'][0]) == 53
  np.testing.assert_allclose(metrics['grad_norm'][0], optax.tree.norm(per_token), rtol=1e-6)
  assert float(metrics['grad_norm'][0]) > 0.1


@pytest.mark.parametrize('clip', [0.0, 1.0])
def test_the_packed_state_is_three_vectors_and_scalars_and_unpacks_to_the_trees(clip):
  config = tiny.get_config()
  config.grad_clip_norm = clip  # another optimizer state: clipping's, then Adam's
  trees = train_step.initial_state(config)
  trees = trees.replace(opt_state=jax.tree_util.tree_map(  # moments that differ from each other
      lambda x: np.random.default_rng(x.size).normal(size=x.shape).astype(x.dtype),
      trees.opt_state))
  packed = packing.pack_state(trees)
  # The parameters and Adam's two moments as a vector each; the step and the optimizer's counts.
  size = sum(x.size for x in jax.tree_util.tree_leaves(trees.params))
  shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(packed)]
  assert sorted(shapes) == [()] * (len(shapes) - 3) + [(size,)] * 3 and len(shapes) <= 7
  steps = train_step.StepFunctions(config, choice.for_this_machine(config))
  again = packing.unpack_state(packed, steps.param_shapes)
  assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(trees)
  for x, y in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(trees)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_a_step_on_the_packed_state_makes_adams_update_of_the_trees():
  config, implementations, state, batch = _setup()
  steps = train_step.StepFunctions(config, implementations)
  new_state, _ = _update(steps, state, batch, jax.local_devices()[:1])
  # The same update from the trees: the gradients unpacked, optax's Adam array by array.
  replicated = jax_utils.replicate(state, jax.local_devices()[:1])
  grads, sums = jax.pmap(steps.gradients, train_step.AXIS, devices=jax.local_devices()[:1])(
      replicated, {k: v[None] for k, v in batch.items()}, np.zeros(1, np.int32))
  grads = steps.params_tree(jax.tree_util.tree_map(lambda g: g[0] / float(sums['tokens'][0]),
                                                   grads))
  trees = packing.unpack_state(state, steps.param_shapes)
  expected = trees.apply_gradients(grads=grads)
  got = packing.unpack_state(new_state, steps.param_shapes)
  assert int(got.step) == 1
  assert _max_difference(trees.params, expected.params) > 1e-5
  for x, y in zip(jax.tree_util.tree_leaves((got.params, got.opt_state)),
                  jax.tree_util.tree_leaves((expected.params, expected.opt_state)), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9)
