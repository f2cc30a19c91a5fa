"""The profiling benchmark's reading of XLA's optimized HLO."""

import jax
import jax.numpy as jnp

from benchmarks.profile_step import hlo_classes


def test_hlo_operations_are_classed_by_what_they_compute():
  def step(a, b):
    return jnp.tanh(a @ b).sum(), jnp.exp(a).sum(), a.T * 2.0, a.T

  a = jnp.ones((64, 32))
  hlo = jax.jit(step).lower(a, a.T).compile().as_text()
  classes = hlo_classes(hlo)
  entry = hlo[hlo.index('ENTRY'):]
  executed = {name: kind for name, (kind, _) in classes.items() if f'%{name} = ' in entry}
  kinds = sorted(kind for kind in executed.values() if kind != 'other')
  # One matmul (the dot, whatever XLA fuses into it), one reduction (exp then sum), and the
  # transposes: a plain copy (layout) and one fused with a multiply (elementwise).
  assert kinds.count('matmul') == 1, executed
  assert 'reduction' in kinds and 'layout' in kinds and 'elementwise' in kinds, executed
  (matmul,) = [name for name, kind in executed.items() if kind == 'matmul']
  assert classes[matmul][1].endswith('dot_general')  # named by its dot, not its fusion's root
