"""A counter-based PRNG for dropout masks: each element's bits are a hash of (key, its index).

JAX's generators draw dropout bits at a large share of a CPU training step (XLA's RngBitGenerator
and threefry expand into loops that neither fuse nor vectorise); these bits are a few integer
multiplies and shifts per element that XLA fuses into the op consuming them, and they are the same
on every backend. Keys are threefry's (seeding, `split`, `fold_in`), so only the bits differ.
"""

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np

_THREEFRY = jax.extend.random.threefry_prng_impl


def _mix(x: jax.Array) -> jax.Array:
  """lowbias32 (C. Wellons, hash-prospector): a bijection of uint32 with near-ideal avalanche."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def mixed_words(key_data: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two uint32 words that `bits` hashes each index with, from a key's data (uint32[2]): mixed
  first, so that keys close together (seeds 0, 1, ...) start far apart."""
  first = _mix(key_data[0] ^ jnp.uint32(0x9E3779B9))
  return first, _mix(key_data[1] + first)


def bits_of_index(index: jax.Array, words: tuple[jax.Array, jax.Array]) -> jax.Array:
  """The uint32 bits of the elements at these flat (row-major) indices, for a key of these
  `mixed_words`."""
  first, second = words
  return _mix(_mix(index ^ first) + second)


def bits(words: tuple[jax.Array, jax.Array], shape: tuple[int, ...]) -> jax.Array:
  """uint32 bits of `shape` for a key of these `mixed_words`: what `jax.random.bits` draws."""
  size = int(np.prod(shape))
  if size >= 2**32:
    raise ValueError(f'hash_rng draws at most 2**32 - 1 values per call, not {size} ({shape})')
  return bits_of_index(jax.lax.iota(jnp.uint32, size).reshape(shape), words)


def kept(bits: jax.Array, keep: float) -> jax.Array:
  """jax.random.bernoulli(key, keep) from the key's uint32 bits: jax takes their top 23 as a float
  in [0, 1) and keeps those below float32(keep), which are the integers below this bound."""
  bound = int(np.ceil(np.float64(np.float32(keep)) * 2**23))
  return (bits >> 9) < jnp.uint32(bound)


def _bits32(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return bits(mixed_words(key), shape)


def _random_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
  if bit_width == 64:
    high, low = _bits32(key, (2, *shape)).astype(jnp.uint64)
    return (high << 32) | low
  return _bits32(key, tuple(shape)).astype(jnp.dtype(f'uint{bit_width}'))


IMPL = jax.extend.random.define_prng_impl(
    key_shape=_THREEFRY.key_shape, seed=_THREEFRY.seed, split=_THREEFRY.split,
    fold_in=_THREEFRY.fold_in, random_bits=_random_bits, name='hash', tag='hsh')
