"""Pmapped programs compiled ahead of time: once per key, whichever threads ask."""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from transformer.kernels import compile_ahead


def test_threads_asking_for_one_shape_share_one_compilation(monkeypatch):
  programs = compile_ahead.Programs(jax.pmap(lambda x: 2 * x))
  compile_program, compiling, release = programs._compile, threading.Event(), threading.Event()
  calls = []

  def slow_compile(key, args):  # holds the first compilation until the second thread is waiting
    calls.append(threading.current_thread().name)
    compiling.set()
    assert release.wait(10)
    return compile_program(key, args)

  monkeypatch.setattr(programs, '_compile', slow_compile)
  x = np.arange(3, dtype=np.float32)[None]
  results = {}
  first = threading.Thread(target=lambda: results.update(first=programs.get('a', x)),
                           name='first')
  first.start()
  assert compiling.wait(10)
  second = threading.Thread(target=lambda: results.update(second=programs.get('a', x)),
                            name='second')
  second.start()
  second.join(0.2)
  assert second.is_alive()  # waiting for the first thread's compilation, not compiling its own
  release.set()
  first.join(10)
  second.join(10)
  assert calls == ['first'] and results['first'] is results['second']
  np.testing.assert_array_equal(results['first'](x), 2 * x)
  # Another key is another program; shape structs compile as arrays do.
  y = jax.ShapeDtypeStruct((1, 5), jnp.float32)
  assert programs.get('b', y) is not results['first'] and calls == ['first', 'MainThread']
  assert set(programs.compiled) == {'a', 'b'} and programs.compile_secs > 0


def test_a_program_lowered_ahead_is_compiled_from_that_lowering(monkeypatch):
  programs = compile_ahead.Programs(jax.pmap(lambda x: x + 1))
  lowerings = []
  lower = programs.pmapped.lower
  monkeypatch.setattr(programs.pmapped, 'lower', lambda *a: lowerings.append(1) or lower(*a))
  x = np.arange(4, dtype=np.float32)[None]
  programs.lower('a', x)
  programs.lower('a', x)  # already lowered
  assert len(lowerings) == 1 and not programs.compiled
  np.testing.assert_array_equal(programs.get('a', x)(x), x + 1)
  programs.lower('a', x)  # already compiled
  assert len(lowerings) == 1 and set(programs.compiled) == {'a'}
