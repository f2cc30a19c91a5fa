"""One run per workdir: two train.py runs on one workdir, a lock left by a dead run, a bucket's."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from transformer import files, lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_a_second_train_py_on_a_workdir_in_use_names_the_first_and_writes_nothing(tmp_path):
  workdir = str(tmp_path / 'run')
  command = [sys.executable, 'train.py', '--config=configs/tiny.py', f'--workdir={workdir}',
             '--config.num_train_steps=40', '--config.checkpoint_every_steps=20',
             '--config.final_bleu_splits=']
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=1')
  first = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
  time.sleep(0.5)
  second = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
  errors = {process.pid: process.communicate(timeout=600)[1] for process in (first, second)}
  # Whichever took the lock first trained; the other stopped at once, naming it.
  ran, refused = sorted((first, second), key=lambda process: process.returncode)
  assert (ran.returncode, refused.returncode) == (0, 1), errors[refused.pid][-3000:]
  assert 'Traceback' not in errors[refused.pid]
  assert errors[refused.pid].strip().splitlines()[-1].startswith(
      f'train.py: {workdir} is in use by another run (pid {ran.pid} on host {os.uname().nodename}'
      ', started 20')
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    steps = [row['step'] for row in map(json.loads, f) if 'split' not in row]
  assert steps == sorted(set(steps)) and steps[-1] == 40  # one run's rows
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['20', '40']
  # The lock names no one once its run has ended.
  assert os.path.getsize(os.path.join(workdir, lock.LOCK_FILE)) == 0


def two_hosts_refused(workdir: str, env: dict) -> list[str]:
  """The last stderr lines of the two processes of a two-host train.py on `workdir`, whose lock
  the caller holds; both must stop at once, with status 1 and one line."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  processes = [subprocess.Popen(
      [sys.executable, 'train.py', '--config=configs/tiny.py', f'--workdir={workdir}',
       f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', f'--process_id={i}'],
      cwd=ROOT, env=dict(env, XLA_FLAGS='--xla_force_host_platform_device_count=1'),
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  errors = [process.communicate(timeout=600)[1] for process in processes]
  for process, stderr in zip(processes, errors):
    assert process.returncode == 1 and 'Traceback' not in stderr, stderr[-3000:]
  return [stderr.strip().splitlines()[-1] for stderr in errors]


@pytest.mark.slow
def test_the_hosts_of_a_multi_host_run_all_stop_on_a_held_lock(tmp_path):
  workdir = str(tmp_path / 'run')
  os.mkdir(workdir)
  with lock.hold(workdir):
    first, second = two_hosts_refused(workdir, dict(os.environ))
  assert first.startswith(f'train.py: {workdir} is in use by another run (pid {os.getpid()} on '
                          f'host {socket.gethostname()}, started ')
  assert second == (f'train.py: {workdir} is in use by another run (process 0 says which)')
  assert os.listdir(workdir) == [lock.LOCK_FILE]


def test_a_lock_left_by_a_dead_run_does_not_block_and_a_held_one_does(tmp_path):
  dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                        capture_output=True, text=True, check=True)
  (tmp_path / lock.LOCK_FILE).write_text(json.dumps({'host': os.uname().nodename,
                                                     'pid': int(dead.stdout)}))
  with lock.hold(str(tmp_path)):
    with pytest.raises(lock.LockedError, match=rf'\(pid {os.getpid()} on host '):
      with lock.hold(str(tmp_path)):
        pass
  with lock.hold(str(tmp_path)):  # released
    pass


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """A local directory that `lock.hold` treats as a bucket, with no wait to read a lock back."""
  monkeypatch.setattr(files, 'is_remote', lambda path: True)
  monkeypatch.setattr(lock, 'SETTLE_SECS', 0)
  return str(tmp_path)


def _other_run(bucket: str, age: float):
  holder = {'host': 'host-b', 'pid': 7, 'started': '2026-01-01T00:00:00+00:00', 'token': 'b',
            'refreshed': time.time() - age}
  with open(os.path.join(bucket, lock.LOCK_FILE), 'w', encoding='utf-8') as f:
    json.dump(holder, f)


def test_a_bucket_lock_refuses_a_fresh_holder_and_takes_over_a_stale_one(bucket):
  _other_run(bucket, age=10)
  with pytest.raises(lock.LockedError, match=r'in use by another run \(pid 7 on host host-b, '
                     r'started 2026-01-01T00:00:00\+00:00\): .* it was rewritten 10 s ago'):
    with lock.hold(bucket):
      pass
  _other_run(bucket, age=lock.STALE_SECS + 1)
  with lock.hold(bucket):
    with open(os.path.join(bucket, lock.LOCK_FILE), encoding='utf-8') as f:
      assert json.load(f)['pid'] == os.getpid()
  assert not os.path.exists(os.path.join(bucket, lock.LOCK_FILE))  # released: removed


def test_a_bucket_lock_is_rewritten_while_held_and_two_at_once_leave_one_holder(bucket,
                                                                              monkeypatch):
  monkeypatch.setattr(lock, 'REFRESH_SECS', 0.05)
  path = os.path.join(bucket, lock.LOCK_FILE)
  with lock.hold(bucket):
    with open(path, encoding='utf-8') as f:
      first = json.load(f)['refreshed']
    time.sleep(0.3)
    with open(path, encoding='utf-8') as f:
      assert json.load(f)['refreshed'] > first
  # Another run writes its lock while this one waits to read its own back: this one yields.
  monkeypatch.setattr(lock, 'REFRESH_SECS', 60)
  monkeypatch.setattr(lock.time, 'sleep', lambda secs: _other_run(bucket, age=0))
  with pytest.raises(lock.LockedError, match='pid 7 on host host-b.*started at the same time'):
    with lock.hold(bucket):
      pass
