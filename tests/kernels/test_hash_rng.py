"""The dropout PRNG: uniform, independent bits, deterministic per key, keys as threefry's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.kernels import hash_rng

N = 1 << 20
SIGMAS = 5  # tolerance of each statistical check, in standard deviations


def _key(seed=0):
  return jax.random.key(seed, impl=hash_rng.IMPL)


def _bits(key, shape=(N,), dtype=jnp.uint32):
  return np.asarray(jax.random.bits(key, shape, dtype))


def test_each_bit_is_one_half_the_time():
  bits = _bits(jax.random.fold_in(_key(), 1))
  ones = ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).mean(axis=0)
  np.testing.assert_array_less(np.abs(ones - 0.5), SIGMAS * 0.5 / np.sqrt(N))


def test_the_bits_of_a_keys_mixed_words_are_the_keys_bits():
  key = jax.random.fold_in(_key(), 4)
  words = hash_rng.mixed_words(jax.random.key_data(key))
  np.testing.assert_array_equal(hash_rng.bits(words, (8, 16)), _bits(key, (8, 16)))
  other = hash_rng.mixed_words(jax.random.key_data(jax.random.fold_in(_key(), 5)))
  assert (np.asarray(hash_rng.bits(other, (8, 16))) != _bits(key, (8, 16))).mean() > 0.99


def test_dropout_keeps_the_configured_share():
  keep = np.asarray(jax.random.bernoulli(jax.random.fold_in(_key(), 2), 0.9, (N,)))
  assert abs(keep.mean() - 0.9) < SIGMAS * np.sqrt(0.09 / N)


@pytest.mark.parametrize('case', ['neighbours', 'rows', 'folded keys', 'split keys', 'seeds'])
def test_masks_are_uncorrelated(case):
  """Neighbouring elements, rows of one draw, and draws from related keys look independent."""
  key = jax.random.fold_in(_key(), 3)
  uniform = lambda k, shape=(N,): np.asarray(jax.random.uniform(k, shape)).reshape(-1)
  if case == 'neighbours':
    u = uniform(key)
    a, b = u[:-1], u[1:]
  elif case == 'rows':
    u = np.asarray(jax.random.uniform(key, (2, N)))
    a, b = u
  elif case == 'folded keys':
    a, b = uniform(jax.random.fold_in(key, 0)), uniform(jax.random.fold_in(key, 1))
  elif case == 'split keys':
    k1, k2 = jax.random.split(key)
    a, b = uniform(k1), uniform(k2)
  else:
    a, b = uniform(_key(0)), uniform(_key(1))
  assert abs(np.corrcoef(a, b)[0, 1]) < SIGMAS / np.sqrt(a.size)


def test_bits_follow_from_the_key_alone():
  key = jax.random.fold_in(_key(5), 7)
  np.testing.assert_array_equal(_bits(key, (64,)), _bits(key, (64,)))
  np.testing.assert_array_equal(_bits(key, (8, 8)).reshape(-1), _bits(key, (64,)))
  jitted = jax.jit(lambda k: jax.random.bits(k, (64,)))
  np.testing.assert_array_equal(jitted(key), _bits(key, (64,)))
  assert (_bits(key, (64,)) != _bits(jax.random.fold_in(_key(5), 8), (64,))).mean() > 0.99


def test_keys_split_and_fold_in_as_threefry_keys_do():
  key, threefry = _key(3), jax.random.key(3, impl='threefry2x32')
  data = lambda k: np.asarray(jax.random.key_data(k))
  np.testing.assert_array_equal(data(jax.random.fold_in(key, 9)),
                                data(jax.random.fold_in(threefry, 9)))
  np.testing.assert_array_equal(data(jax.random.split(key, 3)), data(jax.random.split(threefry, 3)))


@pytest.mark.parametrize('dtype', [jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64])
def test_narrow_and_wide_draws(dtype):
  with jax.enable_x64(True):
    bits = np.asarray(jax.random.bits(jax.random.fold_in(_key(), 4), (4096,), dtype))
  width = np.dtype(dtype).itemsize * 8
  assert bits.dtype == np.dtype(dtype)
  assert abs(bits.astype(np.float64).mean() / 2.0**width - 0.5) < SIGMAS * np.sqrt(1 / 12 / 4096)
  if width == 64:  # both halves carry bits
    high, low = bits >> np.uint64(32), bits & np.uint64(2**32 - 1)
    assert (high > 0).mean() > 0.99 and (low > 0).mean() > 0.99


def test_too_many_values_for_the_counter_is_an_error():
  with pytest.raises(ValueError, match=r'at most 2\*\*32 - 1 values'):
    jax.jit(lambda k: jax.random.bits(k, (1 << 16, 1 << 16))).lower(_key())  # traced, not run
