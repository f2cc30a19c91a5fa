"""Files on a local disk or in a bucket (gs://, s3://, ... through etils.epath), written so that a
reader never sees half of one."""

import contextlib
import errno
import hashlib
import io
import os
import shutil
import socket
import tempfile
import threading
import urllib.parse
import uuid

from etils import epath


# What `stop_writing` waits for or removes: local temporary files and directories being written,
# appends, and output directories made for a block (`made_for_the_block`) while they are empty.
_TEMPORARIES = set()
_APPENDING = threading.Lock()
_STAGING = set()
_MADE_DIRECTORIES = set()


def stop_writing():
  """Readies the process to end at once (os._exit), with nothing half-written: waits for an
  append under way (`append_line`) and blocks any other, removes the temporary files of writes
  under way (`open_atomically`, `write_directory`), whose paths keep their old contents, and the
  output directories made for them that are still empty."""
  _APPENDING.acquire()
  for path in list(_TEMPORARIES):
    path.unlink(missing_ok=True)
  for path in list(_STAGING):
    shutil.rmtree(path, ignore_errors=True)
  for path in list(_MADE_DIRECTORIES):
    with contextlib.suppress(OSError):  # not empty
      os.rmdir(path)


def is_remote(path: str) -> bool:
  """Whether `path` is a URL of a store (gs://bucket/...) rather than a local path."""
  return '://' in os.fspath(path)


def check_bucket(path: str, given_by: str):
  """Fails within seconds where the bucket of the gs:// `path` cannot be reached: no gcsfs, or
  no route to Cloud Storage (or to STORAGE_EMULATOR_HOST), where gcsfs would retry for ~90 s,
  logging each traceback. Other paths pass.

  Raises:
    DirectoryError: naming `given_by`, the path and the fix.
  """
  if not os.fspath(path).startswith('gs://'):
    return
  try:
    import gcsfs  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as error:
    raise DirectoryError(f"{given_by}: {path} is in a bucket, which needs gcsfs ({error}): pip "
                         "install -e '.[gcs]'") from None
  endpoint = urllib.parse.urlsplit(os.environ.get('STORAGE_EMULATOR_HOST') or
                                   'https://storage.googleapis.com')
  host = endpoint.hostname or endpoint.path  # the variable may hold HOST:PORT alone
  port = endpoint.port or (80 if endpoint.scheme == 'http' else 443)
  try:
    socket.create_connection((host, port), timeout=10).close()
  except OSError as error:
    raise DirectoryError(f'{given_by}: {path}: {host}:{port} cannot be reached '
                         f'({error.strerror or error}); check the network, or give a local '
                         'path') from None


def absolute(path: str) -> str:
  """A local path made absolute; a URL as it is."""
  return os.fspath(path) if is_remote(path) else os.path.abspath(path)


class DirectoryError(ValueError):
  """A directory or file a command writes cannot be made or written; the message names the flag
  or key."""


def make_directory(path: str, given_by: str):
  """Makes the directory `path`, and its parents, where missing: before a command's work, so that
  a wrong path fails first.

  Args:
    path: the directory.
    given_by: the flag or key it comes from, for the error ('--output_dir').

  Raises:
    DirectoryError: a file is in the way, or no permission; the message says which.
  """
  if not os.fspath(path):  # '' would be the working directory
    raise DirectoryError(f'{given_by} is empty; give a directory path')
  try:
    epath.Path(path).mkdir(parents=True, exist_ok=True)
  except OSError as error:
    if os.path.islink(path) and not os.path.exists(path):
      why = f'a symbolic link to {os.readlink(path)}, which leads to no directory'
    elif isinstance(error, FileExistsError):
      why = 'a file of that name exists'
    else:
      why = error.strerror or str(error)
    raise DirectoryError(f'{given_by}: {path} cannot be made a directory ({why}); give a '
                         'directory path') from None


@contextlib.contextmanager
def made_for_the_block(path: str, given_by: str):
  """Makes the directory `path` (`make_directory`) for a block that writes into it; if the block
  fails, one that it made and left empty is removed again.

  Raises:
    DirectoryError: as `make_directory`.
  """
  made = not epath.Path(path).exists() and not is_remote(path)
  make_directory(path, given_by)
  if made:
    _MADE_DIRECTORIES.add(path)
  try:
    yield
  except BaseException:
    if made and not os.listdir(path):
      os.rmdir(path)
    raise
  finally:
    _MADE_DIRECTORIES.discard(path)


def write_directory(path: str, write):
  """write(staging) on a new directory beside the local directory `path`, which is absent or
  empty, then the staging directory moved into its place: `path` holds the whole of it or
  nothing, whenever the process stops. Returns what `write` returns.

  Raises:
    DirectoryError: a write failed (a full disk), or another process filled `path` meanwhile;
      nothing of this one's is left.
  """
  absolute_path = os.path.abspath(path)
  staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(absolute_path)}.tmp-',
                             dir=os.path.dirname(absolute_path))
  _STAGING.add(staging)
  try:
    result = write(staging)
    os.chmod(staging, 0o755)  # mkdtemp's is the owner's alone
    try:
      if os.path.isdir(path):
        os.rmdir(path)  # empty
      os.replace(staging, path)
    except OSError as error:
      if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
        raise
      raise DirectoryError(f'{path} was filled meanwhile, by another process; it is left as it '
                           'is: give a new directory') from None
    return result
  except BaseException as error:
    shutil.rmtree(staging, ignore_errors=True)
    if isinstance(error, OSError):  # a full disk
      raise unwritable(path, error) from None
    raise
  finally:
    _STAGING.discard(staging)


def free_mib(directory: str) -> float | None:
  """The MiB free on a local directory's disk; None in a bucket or where it cannot be read."""
  if is_remote(directory):
    return None
  try:
    return shutil.disk_usage(directory).free / 2**20
  except OSError:
    return None


# Why a write fails where the path is right: no permission, a read-only or full disk.
WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def unwritable(path: str, error: OSError) -> DirectoryError:
  """The one-line error of a write to `path` that failed: why, and the space left there (for a
  full disk)."""
  why = error.strerror or str(error)
  free = free_mib(os.path.dirname(path))
  if error.errno in (errno.ENOSPC, errno.EDQUOT) and free is not None:
    why += f'; {free:.2f} MiB free there'
  return DirectoryError(f'{path} could not be written ({why})')


def check_writable(path: str, given_by: str):
  """Makes the directory of the file `path` (`make_directory`) and checks that a file can be
  written there: before a command's work, so that an output it cannot write fails first, not
  after hours of translation.

  Args:
    path: a file the command will write (`open_atomically`).
    given_by: the flag or key it comes from, for the error ('--output_dir').

  Raises:
    DirectoryError: `path` is a directory, or its directory cannot be made or takes no new file
      (no permission, a read-only disk); the message says which.
  """
  path = _through_links(path)
  make_directory(path.parent, given_by)
  if path.is_dir():
    raise DirectoryError(f'{given_by}: {path} is a directory; give another path, or move it away')
  probe = path.with_name(f'{path.name}.tmp-{uuid.uuid4().hex[:12]}')  # as open_atomically's
  try:
    probe.write_bytes(b'')
    probe.unlink()
  except OSError as error:
    raise DirectoryError(f'{given_by}: {path.parent} takes no new file ({error.strerror or error})'
                         '; give a directory you can write to') from None


def _through_links(path: str) -> epath.Path:
  """`path`, or where it leads if it is a symbolic link: a file written there replaces the link's
  target, not the link."""
  return epath.Path(os.path.realpath(path) if os.path.islink(path) else path)


@contextlib.contextmanager
def open_atomically(path: str, mode: str = 'wb'):
  """A file opened for writing (`mode` 'wb' or 'w', UTF-8) that appears at `path` whole, once
  the block ends without an error, so that a reader sees the old file or the new one, never a
  part.

  Locally: a temporary file beside `path`, renamed over it (removed if the block fails). In a
  bucket: the bytes kept in memory and uploaded in one request once the block succeeds, as a
  file that closes uploads what it was given even when the block failed (a bucket's files here
  are small: configs, metrics, vocabularies, translations).
  """
  path = _through_links(path)
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    raise unwritable(path, error) from None
  if is_remote(path):
    buffer = io.BytesIO() if 'b' in mode else io.StringIO()
    yield buffer
    content = buffer.getvalue()
    path.write_bytes(content if isinstance(content, bytes) else content.encode('utf-8'))
    return
  # Unique across hosts and containers, whose process ids can repeat.
  target = path.with_name(f'{path.name}.tmp-{uuid.uuid4().hex[:12]}')
  _TEMPORARIES.add(target)
  try:
    with target.open(mode, **({} if 'b' in mode else {'encoding': 'utf-8'})) as f:
      yield f
    os.replace(target, path)
  except BaseException as error:
    target.unlink(missing_ok=True)
    if isinstance(error, OSError):
      raise unwritable(path, error) from None
    raise
  finally:
    _TEMPORARIES.discard(target)


def sha256(path: str) -> str:
  """The SHA-256 of a file's bytes (hex), read in chunks: gigabyte files need no gigabyte of RAM."""
  digest = hashlib.sha256()
  with epath.Path(path).open('rb') as f:
    for chunk in iter(lambda: f.read(2**20), b''):
      digest.update(chunk)
  return digest.hexdigest()


def write_atomically(path: str, content: str | bytes):
  """Writes `content` to `path` so that a reader sees the old file or the new one, never a part
  (`open_atomically`)."""
  with open_atomically(path, 'wb' if isinstance(content, bytes) else 'w') as f:
    f.write(content)


def append_line(path: str, line: str):
  """Adds `line` and a newline at the end of `path`. A bucket's objects cannot grow: there the
  file is written again whole, with the line added (`write_atomically`)."""
  if not is_remote(path):
    with _APPENDING:
      try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
      except OSError as error:
        raise unwritable(path, error) from None
      try:
        end = os.lseek(fd, 0, os.SEEK_END)
        remaining = memoryview((line + '\n').encode('utf-8'))
        while remaining:
          remaining = remaining[os.write(fd, remaining):]
      except OSError as error:  # a full disk: no half line stays
        os.ftruncate(fd, end)
        raise unwritable(path, error) from None
      finally:
        os.close(fd)
    return
  old = epath.Path(path).read_text(encoding='utf-8') if epath.Path(path).exists() else ''
  write_atomically(path, old + line + '\n')
