"""Files on a local disk or in a bucket (gs://, s3://, ... through etils.epath), written so that a
reader never sees half of one."""

import os

from etils import epath


def is_remote(path: str) -> bool:
  """Whether `path` is a URL of a store (gs://bucket/...) rather than a local path."""
  return '://' in os.fspath(path)


def absolute(path: str) -> str:
  """A local path made absolute; a URL as it is."""
  return os.fspath(path) if is_remote(path) else os.path.abspath(path)


def write_atomically(path: str, content: str | bytes):
  """Writes `content` to `path` so that a reader sees the old file or the new one, never a part.

  Locally: a temporary file beside `path`, renamed over it. In a bucket an object appears only
  once its upload is complete, so it is written in place (a rename there is a copy).
  """
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if is_remote(path):
    target = path
  else:
    target = path.with_name(f'{path.name}.tmp{os.getpid()}')
  if isinstance(content, bytes):
    target.write_bytes(content)
  else:
    target.write_text(content, encoding='utf-8')
  if target != path:
    os.replace(target, path)


def append_line(path: str, line: str):
  """Adds `line` and a newline at the end of `path`. A bucket's objects cannot grow: there the
  file is written again whole, with the line added (`write_atomically`)."""
  if not is_remote(path):
    with open(path, 'a', encoding='utf-8') as f:
      f.write(line + '\n')
    return
  old = epath.Path(path).read_text(encoding='utf-8') if epath.Path(path).exists() else ''
  write_atomically(path, old + line + '\n')
