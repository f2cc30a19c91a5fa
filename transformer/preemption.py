"""Preemption: a SIGTERM (Cloud TPU's notice) or Ctrl-C makes the training loop checkpoint at
the step it is at and stop; while there is nothing to save the process ends at once. Hosts agree
on such events (`agree`), so that all of them save at the same step."""

import os
import signal
import socket
import threading

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from transformer import interrupts
from transformer.files import stop_writing


class Preemption:
  """Remembers a SIGTERM (preemption) or a first Ctrl-C (SIGINT) so the loop can checkpoint at the
  current step and stop cleanly; a second Ctrl-C stops at once.

  While there is nothing to save (preparing the data, compiling the first step, the closing
  BLEU; `exit_message` then says what is saved), the signal ends the process at once, even inside
  a library's long call (a vocabulary's training, a compilation, a beam search), where Python
  runs no handler until it returns: a thread woken by the signal itself (`signal.set_wakeup_fd`)
  logs what is saved and exits with status 0, nothing half-written (`files.stop_writing`).
  """

  def __init__(self):
    self.received = False
    self.signal_name = 'a signal to another host'  # what `received` comes from, once it is true
    self.exit_message = None  # while there is nothing to save: the line a signal exits with
    signums = [signal.SIGTERM]
    # A SIGINT that was ignored stays so, as for a job a script starts in the background.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
      signums.append(signal.SIGINT)
    self._previous = {signum: signal.signal(signum, self._handle) for signum in signums}
    self._wakeup, wakeup = socket.socketpair()
    wakeup.setblocking(False)
    self._previous_wakeup_fd = signal.set_wakeup_fd(wakeup.fileno())
    self._sockets = (self._wakeup, wakeup)
    threading.Thread(target=self._end_at_once, name='preemption', daemon=True).start()

  def _end_at_once(self):
    """Exits as soon as one of the signals arrives while there is nothing to save, or a second
    Ctrl-C arrives; another signal a command ends on (SIGHUP) ends it too."""
    interrupts_seen = 0
    while True:
      try:
        signums = self._wakeup.recv(64)
      except OSError:  # closed by `restore`
        return
      if not signums:
        return
      for signum in signums:
        if signum not in self._previous and signum in interrupts.SIGNALS:
          interrupts.end_now(signum)
      interrupts_seen += signums.count(signal.SIGINT)
      if interrupts_seen >= 2:
        interrupts.end_now(signal.SIGINT)
      received = [signum for signum in signums if signum in self._previous]
      line = self.exit_message
      if received and line is not None:
        stop_writing()
        logging.info('%s: %s; stopping', signal.Signals(received[0]).name, line)
        logging.flush()
        os._exit(0)

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT and not self.received:
      logging.warning('Ctrl-C: a checkpoint of this step, then the end; Ctrl-C again ends at once')
    self.received, self.signal_name = True, signal.Signals(signum).name

  def restore(self):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self.exit_message = None
    signal.set_wakeup_fd(self._previous_wakeup_fd)
    self._wakeup.shutdown(socket.SHUT_RDWR)  # ends the thread's wait
    for end in self._sockets:
      end.close()


def agree(*flags: bool) -> tuple[bool, ...]:
  """Host-local events (a signal, a timer) made true on every host if true on any."""
  if jax.process_count() == 1:
    return flags
  return tuple(bool(x) for x in multihost_utils.process_allgather(np.array(flags)).any(axis=0))
