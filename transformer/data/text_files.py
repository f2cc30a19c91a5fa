"""Reads parallel text files: one sentence per line, UTF-8, optionally gzipped, lines aligned."""

import codecs
import gzip
import zlib

from etils import epath

from transformer.data.errors import DataError

_GZIP_MAGIC = b'\x1f\x8b'


def read_lines(path: str) -> list[str]:
  """The lines of a UTF-8 text file, gzipped or not, without their line ends.

  Raises:
    DataError: the file is missing, a directory or unreadable, a gzipped one is cut short or
      corrupt, or a line is not UTF-8 (naming the file and line).
  """
  if epath.Path(path).is_dir():
    raise DataError(f'{path}: a directory, not a file; give a file of one sentence per line')
  if not epath.Path(path).is_file():
    raise DataError(f'{path}: no such file; check the path (one sentence per line, optional .gz)')
  try:
    raw = epath.Path(path).read_bytes()
  except OSError as error:
    raise DataError(f'{path}: cannot be read ({error.strerror or error})') from None
  return decode_lines(raw, path)


def decode_lines(raw: bytes, name: str) -> list[str]:
  """The lines of UTF-8 `raw` text read from `name` (a file, or '<stdin>'), gzipped or not, a
  byte-order mark at its start dropped (editors on Windows write one; it would join the first
  word).

  Raises:
    DataError: gzipped text is cut short or corrupt, or a line is not UTF-8; the message names
      `name`, the line and the fix.
  """
  if raw[:2] == _GZIP_MAGIC:  # by content: downloaded copies lose the .gz suffix
    try:
      raw = gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as error:  # cut short; corrupt
      raise DataError(f'{name}: not a whole gzip file ({error or "it ends early"}); download or '
                      'copy it again') from None
  lines = raw.removeprefix(codecs.BOM_UTF8).split(b'\n')
  if lines and not lines[-1]:
    lines.pop()  # the final newline ends the last line
  decoded = []
  for number, line in enumerate(lines, 1):
    try:
      decoded.append(line.decode('utf-8').rstrip('\r'))
    except UnicodeDecodeError as error:
      raise DataError(f'{name}:{number}: invalid UTF-8 ({error.reason} at byte {error.start}); '
                      're-encode the text as UTF-8') from None
  return decoded


def read_parallel(source_path: str, target_path: str) -> tuple[list[str], list[str]]:
  """Aligned lines of two files. Both sides empty: kept (dropped later); one side empty: error."""
  sources, targets = read_lines(source_path), read_lines(target_path)
  if len(sources) != len(targets):
    raise DataError(f'{source_path} has {len(sources)} lines but {target_path} has '
                    f'{len(targets)}: the files must be line-aligned translations')
  for number, (source, target) in enumerate(zip(sources, targets), 1):
    if bool(source.strip()) != bool(target.strip()):
      empty, other = (source_path, target_path) if not source.strip() else (target_path,
                                                                            source_path)
      raise DataError(f'{empty}:{number}: empty line, but line {number} of {other} is not; the '
                      'files are probably misaligned: fix or delete the pair')
  return sources, targets
