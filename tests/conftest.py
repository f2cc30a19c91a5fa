"""Test session set-up: four simulated CPU devices (as on 4 chips), and where Multi30k is."""

import os

import pytest

# Must happen before JAX starts; the tests that need one device take the first one.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=4').strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='session')
def multi30k_dir() -> str:
  """The Multi30k files (MULTI30K_DIR, default ../shared/data/multi30k); required when CI=true."""
  path = os.path.join(ROOT, os.environ.get('MULTI30K_DIR', os.path.join('..', 'shared', 'data',
                                                                         'multi30k')))
  if not os.path.isfile(os.path.join(path, 'train.en.gz')):
    message = f'Multi30k not found in {path} (set MULTI30K_DIR)'
    if os.environ.get('CI') == 'true':
      pytest.fail(message)
    pytest.skip(message)
  return path
