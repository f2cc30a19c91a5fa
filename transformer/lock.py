"""One run per workdir: a lock that a second run sees at once, naming the run that holds it.

On a local disk (NFS too) the lock is the kernel's (`fcntl.flock` on `<workdir>/run.lock`): it
ends with the process that holds it, however that process ends, so a run that died never blocks
the next one. A bucket has no such lock: there `run.lock` is an object that its run rewrites
every REFRESH_SECS, and one not rewritten for STALE_SECS is taken over.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket
import threading
import time
import uuid

import jax
from absl import logging
from etils import epath

from transformer import files
from transformer.preemption import agree

LOCK_FILE = 'run.lock'  # in a workdir
REFRESH_SECS = 60
STALE_SECS = 300
SETTLE_SECS = 2  # a bucket lock is read back after this: two runs that wrote at once see who won


class LockedError(RuntimeError):
  """Another run holds the workdir; the message names it and what to do."""


def _holder() -> dict:
  return {'host': socket.gethostname(), 'pid': os.getpid(),
          'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
          'token': uuid.uuid4().hex, 'refreshed': time.time()}


def _in_use(workdir: str, holder: dict, fix: str) -> LockedError:
  who = (f'pid {holder.get("pid")} on host {holder.get("host")}, started '
         f'{holder.get("started")}' if holder else 'a run still starting')
  return LockedError(f'{workdir} is in use by another run ({who}): {fix}, or give another '
                     '--workdir')


def _read(path: epath.Path) -> dict:
  """The holder a lock file names; {} where it names none (empty, being written, or damaged)."""
  try:
    holder = json.loads(path.read_text(encoding='utf-8') or '{}')
  except (OSError, ValueError):
    return {}
  return holder if isinstance(holder, dict) else {}


class _KernelLock:
  """`fcntl.flock` on a local file, whose contents name the holder."""

  def __init__(self, path: epath.Path, workdir: str):
    self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      os.ftruncate(self.fd, 0)
      os.write(self.fd, json.dumps(_holder()).encode('utf-8'))
    except BaseException as error:
      os.close(self.fd)
      if isinstance(error, BlockingIOError):
        raise _in_use(workdir, _read(path), 'wait for it to end or stop it') from None
      raise

  def release(self):
    os.ftruncate(self.fd, 0)  # names no one; the file stays, as another run may have it open
    os.close(self.fd)  # and with it the lock


class _ObjectLock:
  """A lock object in a bucket (any `epath` path), rewritten by a thread while it is held."""

  def __init__(self, path: epath.Path, workdir: str):
    self.path, self.holder = path, _holder()
    if path.exists():
      other = _read(path)
      age = time.time() - other.get('refreshed', 0)
      if age < STALE_SECS:
        raise _in_use(workdir, other, f'wait for it to end or stop it (a run that died leaves '
                      f'its lock for {STALE_SECS} s; it was rewritten {age:.0f} s ago), or '
                      f'delete {path} if that run is gone')
    files.write_atomically(path, json.dumps(self.holder))
    time.sleep(SETTLE_SECS)
    other = _read(path)
    if other.get('token') != self.holder['token']:
      raise _in_use(workdir, other, 'it started at the same time as this one')
    self.stopped = threading.Event()
    self.thread = threading.Thread(target=self._refresh, name='workdir_lock', daemon=True)
    self.thread.start()

  def _refresh(self):
    while not self.stopped.wait(REFRESH_SECS):
      self.holder['refreshed'] = time.time()
      try:
        files.write_atomically(self.path, json.dumps(self.holder))
      except Exception as error:  # a bucket's passing fault: the next minute tries again
        logging.warning('%s not rewritten: %s', self.path, error)

  def release(self):
    self.stopped.set()
    self.thread.join()
    if _read(self.path).get('token') == self.holder['token']:
      self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def hold(workdir: str):
  """Holds `<workdir>/run.lock` for the block, process 0 for every host; the directory must exist.

  Raises:
    LockedError: another run holds it (on every host); the message names that run (host, pid,
      start) and what to do.
    files.DirectoryError: the lock file cannot be made (a directory in its place, no permission).
  """
  lock = error = None
  if jax.process_index() == 0:
    try:
      lock = _take(epath.Path(workdir) / LOCK_FILE, workdir)
    except LockedError as locked:
      error = locked
  if agree(error is not None)[0]:
    raise error or LockedError(f'{workdir} is in use by another run (process 0 says which)')
  try:
    yield
  finally:
    if lock is not None:
      lock.release()


def _take(path: epath.Path, workdir: str):
  """The lock at `path`: the kernel's on a local disk, an object in a bucket."""
  try:
    return (_ObjectLock if files.is_remote(workdir) else _KernelLock)(path, workdir)
  except OSError as error:
    raise files.DirectoryError(f'--workdir: {path} cannot be made the run\'s lock '
                               f'({error.strerror or error}); move it away') from None
