"""Local files that a reader never sees half of, and outputs checked before the work: a directory
in the way, a read-only disk, a write that fails part-way (a full disk, stood in for by a limit on
file sizes, which fails a write the same way)."""

import errno
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from transformer import files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_output_that_can_be_written_is_checked_without_leaving_anything(tmp_path):
  files.check_writable(str(tmp_path / 'new' / 'scores.json'), '--output_dir')
  assert os.listdir(tmp_path / 'new') == []  # its directory made, the probe removed


@pytest.mark.parametrize('where, message', [
    ('directory', '--output_dir: {tmp}/scores.json is a directory; give another path, or move '
     'it away'),
    ('read-only', '--output_dir: /sys takes no new file (Permission denied); give a directory '
     'you can write to'),
    ('under a file', '--output_dir: {tmp}/file cannot be made a directory (a file of that name '
     'exists); give a directory path'),
])
def test_an_output_that_cannot_be_written_is_named_with_the_fix(tmp_path, where, message):
  (tmp_path / 'scores.json').mkdir()
  (tmp_path / 'file').write_text('')
  path = {'directory': tmp_path / 'scores.json', 'read-only': '/sys/scores.json',
          'under a file': tmp_path / 'file' / 'scores.json'}[where]
  with pytest.raises(files.DirectoryError, match=re.escape(message.format(tmp=tmp_path))):
    files.check_writable(str(path), '--output_dir')


_FULL_DISK = """
import resource, sys
from transformer import files
path, = sys.argv[1:]
files.write_atomically(path, 'old\\n')
files.append_line(path, 'a whole line')
resource.setrlimit(resource.RLIMIT_FSIZE, (len('old\\na whole line\\n') + 8,) * 2)
for write in (lambda: files.append_line(path, 'a line that does not fit'),
              lambda: files.write_atomically(path, 'new contents, too long to fit')):
  try:
    write()
  except files.DirectoryError as error:
    print(error)
"""


def test_a_write_that_fails_part_way_leaves_the_file_as_it_was_and_says_why(tmp_path):
  path = str(tmp_path / 'metrics.jsonl')
  result = subprocess.run([sys.executable, '-c', _FULL_DISK, path], cwd=ROOT, capture_output=True,
                          text=True, check=True)
  said = result.stdout.splitlines()
  assert said == [f'{path} could not be written (File too large)'] * 2
  with open(path, encoding='utf-8') as f:
    assert f.read() == 'old\na whole line\n'  # no half line, no half file
  assert os.listdir(tmp_path) == ['metrics.jsonl']  # no temporary file
  # A full disk's error says how much space is left there.
  full = files.unwritable(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
  free = shutil.disk_usage(tmp_path).free / 2**20
  assert re.fullmatch(rf'{re.escape(path)} could not be written \(No space left on device; '
                      r'([\d.]+) MiB free there\)', str(full))
  assert abs(float(re.search(r'; ([\d.]+) MiB', str(full))[1]) - free) < 10


def test_a_file_written_through_a_symbolic_link_replaces_its_target_and_keeps_the_link(tmp_path):
  (tmp_path / 'target.txt').write_text('old\n', encoding='utf-8')
  os.symlink('target.txt', tmp_path / 'link.txt')
  files.check_writable(str(tmp_path / 'link.txt'), '--output')
  files.write_atomically(str(tmp_path / 'link.txt'), 'new\n')
  assert os.readlink(tmp_path / 'link.txt') == 'target.txt'
  assert (tmp_path / 'target.txt').read_text(encoding='utf-8') == 'new\n'
  assert sorted(os.listdir(tmp_path)) == ['link.txt', 'target.txt']


def test_a_directory_another_process_fills_first_is_left_as_it_is(tmp_path):
  """Two commands writing one new OUT at once (export.py, average_checkpoints.py): the second to
  finish leaves the first's OUT and none of its own files, and says so in one line."""
  out = tmp_path / 'out'

  def write(staging):  # meanwhile, the other process publishes its OUT
    (pathlib.Path(staging) / 'mine.txt').write_text('mine')
    out.mkdir()
    (out / 'theirs.txt').write_text('theirs')

  with pytest.raises(files.DirectoryError) as error:
    files.write_directory(str(out), write)
  assert str(error.value) == (f'{out} was filled meanwhile, by another process; it is left as it '
                              'is: give a new directory')
  assert sorted(map(str, tmp_path.rglob('*'))) == [str(out), f'{out}/theirs.txt']
