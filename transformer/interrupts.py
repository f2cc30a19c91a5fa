"""How a command ends on Ctrl-C (SIGINT), SIGTERM or SIGHUP: at once, in one line, with the files
it was writing as they were.

A command starts this before its other imports, which take seconds (JAX, Flax, TFDS), so that
it imports nothing but the standard library. Python's own Ctrl-C, a KeyboardInterrupt, fails
three ways here: raised inside an import it is a page of traceback; inside JAX's garbage
collector callback it is printed and dropped, and the command runs on; and the interpreter's
exit that follows it can crash (a segmentation fault) while XLA compiles on another thread.
"""

import os
import signal
import socket
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_NAMES = {signal.SIGINT: 'Ctrl-C', signal.SIGTERM: 'SIGTERM', signal.SIGHUP: 'SIGHUP'}
_command = []  # the command's name, once `end_at_once` is started


def end_now(signum: int):
  """Ends the process at once after `signum`: removes what was being written (`files.
  stop_writing`), says so in one line and exits with the signal's status (128 + its number)."""
  files = sys.modules.get('transformer.files')  # not imported yet: nothing is being written
  if files is not None:
    files.stop_writing()
  command = _command[0] if _command else os.path.basename(sys.argv[0])
  name = _NAMES.get(signum, signal.Signals(signum).name)
  print(f'{command}: stopped by {name}; the files it was writing are as they were',
        file=sys.stderr, flush=True)
  os._exit(128 + signum)


def end_at_once(command: str):
  """Ends the process at once (`end_now`) on SIGINT, SIGTERM or SIGHUP, even inside a library's
  long call (an import, a compilation, a beam search), where Python runs no handler until it
  returns: a thread woken by the signal itself (`signal.set_wakeup_fd`) does it. A signal that
  is ignored (SIGINT for a script's background job, SIGHUP under nohup) stays ignored. Once per
  process; train.py's loop puts its own handling in place while there is something to save.

  Args:
    command: its name in the line, e.g. 'eval.py'.
  """
  if _command:
    return
  _command.append(command)
  handled = [signum for signum in SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]
  woken, wakeup = socket.socketpair()
  wakeup.setblocking(False)
  for signum in handled:
    signal.signal(signum, lambda signum, frame: None)  # the thread's to handle
  signal.set_wakeup_fd(wakeup.fileno())

  def wait(sockets):  # both held here: a socket closes once nothing refers to it
    while True:
      received = [signum for signum in sockets[0].recv(64) if signum in handled]
      if received:
        end_now(received[0])

  threading.Thread(target=wait, args=((woken, wakeup),), name='interrupts', daemon=True).start()
