"""Pmapped programs compiled ahead of time: once per key, whichever threads ask."""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from transformer import compiled


def test_threads_asking_for_one_shape_share_one_compilation(monkeypatch):
  programs = compiled.Programs(jax.pmap(lambda x: 2 * x))
  compile_program, compiling, release = programs._compile, threading.Event(), threading.Event()
  calls = []

  def slow_compile(args):  # holds the first compilation until the second thread is waiting
    calls.append(threading.current_thread().name)
    compiling.set()
    assert release.wait(10)
    return compile_program(args)

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
