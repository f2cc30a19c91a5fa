"""Writing files so that a reader never sees half of one."""

import os


def write_atomically(path: str, content: str | bytes):
  """Writes to a temporary file beside `path`, then renames it over `path`."""
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'wb' if isinstance(content, bytes) else 'w',
            **({} if isinstance(content, bytes) else {'encoding': 'utf-8'})) as f:
    f.write(content)
  os.replace(tmp, path)
