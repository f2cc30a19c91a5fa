"""Dropout with hash_rng's bits (config.implementation.dropout_rng='hash'): the mask drawn
again in the backward pass rather than kept."""

import jax
import jax.numpy as jnp

from transformer.kernels import hash_rng

Array = jax.Array


def is_hash_key(key: Array) -> bool:
  """Whether `key` is a typed key of hash_rng's generator
  (config.implementation.dropout_rng='hash')."""
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and (
      jax.random.key_impl(key) == hash_rng.IMPL)


def _masked(x: Array, keep: Array, rate: float) -> Array:
  """nn.Dropout's output for the keep mask `keep`: kept values scaled by 1 / (1 - rate)."""
  return jax.lax.select(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _hash_dropped(x: Array, words: tuple[Array, Array], rate: float) -> Array:
  return _masked(x, hash_rng.kept(hash_rng.bits(words, x.shape), 1.0 - rate), rate)


def _hash_dropped_grads(rate: float, words: tuple[Array, Array], grads: Array):
  # The barrier keeps XLA from finding the forward's draw in this one and keeping it after all.
  return _hash_dropped(grads, jax.lax.optimization_barrier(words), rate), None


_hash_dropout = jax.custom_vjp(_hash_dropped, nondiff_argnums=(2,))
_hash_dropout.defvjp(lambda x, words, rate: (_hash_dropped(x, words, rate), words),
                     _hash_dropped_grads)


def dropout(x: Array, key: Array, rate: float) -> Array:
  """nn.Dropout's output for a hash_rng key, its mask drawn again in the backward pass rather
  than kept: a few integer operations per element that fuse into the kernels on either side, so
  the mask is neither written nor read."""
  return _hash_dropout(x, hash_rng.mixed_words(jax.random.key_data(key)), rate)
