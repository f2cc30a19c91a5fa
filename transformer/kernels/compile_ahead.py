"""Pmapped programs compiled ahead of time, once per input shape, from any thread.

A training run lowers its evaluation step and beam searches on a background thread while its
training step compiles, and compiles them while it trains (trainer.py, `Background`); when the
loop needs one, it waits only for that program.
"""

import threading
import time
from collections.abc import Callable, Hashable, Iterable

import jax
from absl import logging


def shapes_of(tree):
  """`tree`'s arrays as ShapeDtypeStructs: what compiling needs, without holding their buffers
  (a training step donates its state's)."""
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class Programs:
  """A `jax.pmap`ped function's compiled programs, one per key (a name for the input shapes).

  Args:
    pmapped: the pmapped function.
  """

  def __init__(self, pmapped):
    self.pmapped = pmapped
    self.compiled = {}  # key -> the compiled program
    self.compile_secs = 0.0  # spent lowering programs not lowered ahead, and compiling
    self._lowered = {}  # key -> the lowered program, by `lower`, not compiled yet
    self._locks = {}

  def lower(self, key: Hashable, *args):
    """Traces and lowers the program for `args` without compiling it (Python work, which holds
    the interpreter; compiling does not)."""
    if jax.process_count() > 1:
      return
    with self._locks.setdefault(key, threading.Lock()):  # setdefault is atomic
      if key not in self.compiled and key not in self._lowered:
        self._lowered[key] = self.pmapped.lower(*shapes_of(args))

  def get(self, key: Hashable, *args) -> Callable:
    """The program for `args` (arrays or ShapeDtypeStructs, leading axis the local devices),
    compiled on the first call with `key`; a call with a key being compiled waits for it."""
    if jax.process_count() > 1:  # pmap's ahead-of-time programs take global arrays there
      return self.pmapped
    with self._locks.setdefault(key, threading.Lock()):
      if key not in self.compiled:
        began = time.time()
        self.compiled[key] = self._compile(key, args)
        self.compile_secs += time.time() - began
    return self.compiled[key]

  def _compile(self, key, args):
    lowered = self._lowered.pop(key, None) or self.pmapped.lower(*shapes_of(args))
    return lowered.compile()


class Background:
  """Programs lowered on a thread of their own at once, and compiled there once `compile` is
  called: lowering is Python work, which would slow the training steps' dispatch were it done
  beside them, while compiling beside the training step's own compilation slowed that."""

  def __init__(self):
    self._thread = None
    self._compiling = threading.Event()  # the training step has compiled: compile the rest
    self._closing = threading.Event()  # stop after the program at hand

  def start(self, planned: Iterable[tuple[Programs, tuple]], what: str):
    """Lowers each (programs, args) of `planned` in its order, then waits for `compile`.

    An error stops the thread with a warning: the caller meets it again where it needs the
    program.
    """
    def until_closed(planned):
      for programs, args in planned:
        if self._closing.is_set():
          return
        yield programs, args

    def work():
      began = time.time()
      try:
        lowered = []
        for programs, args in until_closed(planned):
          programs.lower(*args)
          lowered.append((programs, args))
        self._compiling.wait()
        for programs, args in until_closed(lowered):
          programs.get(*args)
      except Exception as error:  # pylint: disable=broad-exception-caught
        logging.warning('compiling the %s ahead stopped: %s', what, error)
        return
      if not self._closing.is_set():
        logging.info('%s compiled ahead in %.1f s', what, time.time() - began)

    self._thread = threading.Thread(target=work, name='compile_ahead')
    self._thread.start()

  def compile(self):
    """Lets the thread compile what it lowered."""
    self._compiling.set()

  def close(self):
    """Stops the thread after the program at hand, and waits for it."""
    self._closing.set()
    self._compiling.set()
    if self._thread is not None:
      self._thread.join()
