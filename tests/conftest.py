"""Test session set-up: four simulated CPU devices, so data-parallel code runs as on 4 chips."""

import os

# Must happen before JAX starts; the tests that need one device take the first one.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=4').strip()
