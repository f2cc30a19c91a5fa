"""The loss: label smoothing as optax computes it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer import loss

pytestmark = pytest.mark.usefixtures('float32_matmuls')


def test_label_smoothed_loss_equals_optax_smooth_labels():
  logits = jax.random.normal(jax.random.key(0), (2, 5, 11))
  targets = jnp.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 6]])
  sums = loss.token_sums(logits, targets, 0.1)
  smoothed = optax.smooth_labels(jax.nn.one_hot(targets, 11), 0.1)
  weights = targets > 0
  expected = (optax.softmax_cross_entropy(logits, smoothed) * weights).sum()
  np.testing.assert_allclose(sums['loss'], expected, rtol=1e-6)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  np.testing.assert_allclose(sums['nll'], (nll * weights).sum(), rtol=1e-6)
  assert sums['tokens'] == 8
