"""Runs kept in a bucket: train.py, its resume, eval.py, the translate command and
average_checkpoints.py on gs:// paths, and Multi30k's files read from one, against a Cloud
Storage emulator (gcp-storage-emulator) that the tests start. gcsfs (etils.epath, Orbax's
directories), tensorstore (Orbax's arrays) and TensorBoard's writer are all pointed at it."""

import gzip
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from etils import epath

from configs import multi30k as multi30k_config
from conftest import error_line, run_script
from test_lock import two_hosts_refused
from transformer import data, files, lock
from transformer.data import multi30k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = 'gs://runs'
# The emulator, with the x-goog-generation header that Cloud Storage sends with an object's bytes:
# tensorstore reads it to update Orbax's checkpoint manifests conditionally, and fails without it.
EMULATOR = """
import sys
from gcp_storage_emulator import exceptions
from gcp_storage_emulator.handlers import objects
download = objects.download
def with_generation(request, response, storage, *args, **kwargs):
  try:
    stored = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    response['x-goog-generation'] = stored['generation']
  except exceptions.NotFound:
    pass
  return download(request, response, storage, *args, **kwargs)
objects.download = with_generation
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


@pytest.fixture(scope='module')
def emulator_env():
  """The environment that sends gs:// requests to an emulator, set in this process too."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  server = subprocess.Popen(
      [sys.executable, '-c', EMULATOR, 'start', '--port', str(port), '--in-memory',
       '--default-bucket', BUCKET.removeprefix('gs://')],
      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
  deadline = time.time() + 30
  while True:
    try:
      socket.create_connection(('127.0.0.1', port), 0.5).close()
      break
    except OSError:
      assert server.poll() is None and time.time() < deadline, 'the emulator did not start'
      time.sleep(0.2)
  url = f'http://127.0.0.1:{port}'
  env = {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
         'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',  # tensorstore: no credentials lookup
         'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false'}  # gcsfs: the emulator has no such API
  saved = {key: os.environ.get(key) for key in env}
  os.environ.update(env)
  yield dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2')
  for key, value in saved.items():
    if value is None:
      os.environ.pop(key)
    else:
      os.environ[key] = value
  server.terminate()
  server.wait(timeout=30)


def run(env, *args, stdin: str | None = None) -> subprocess.CompletedProcess:
  result = run_script(*args, stdin=stdin, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def write_texts(directory: str) -> list[str]:
  """Gzipped parallel text (English words, German their capitals) in the bucket; the test
  split's English lines."""
  rng = np.random.default_rng(0)
  words = [''.join(rng.choice(list('abcdefghij'), rng.integers(1, 5))) for _ in range(50)]
  for split, size in (('train', 400), ('validation', 24), ('test', 16)):
    lines = [' '.join(rng.choice(words, rng.integers(1, 12))) for _ in range(size)]
    for lang, text in (('en', lines), ('de', [line.upper() for line in lines])):
      epath.Path(f'{directory}/{split}.{lang}.gz').write_bytes(
          gzip.compress(''.join(f'{line}\n' for line in text).encode()))
  return lines


def rows(path: str) -> list[dict]:
  return [json.loads(line) for line in epath.Path(path).read_text().splitlines()]


def test_a_write_that_fails_in_a_bucket_publishes_nothing(emulator_env):
  path = epath.Path(f'{BUCKET}/atomic/scores.json')
  files.write_atomically(str(path), b'old content')
  with pytest.raises(RuntimeError, match='mid-write'):
    with files.open_atomically(str(path)) as f:
      f.write(b'x' * 3000)
      raise RuntimeError('mid-write')
  assert path.read_bytes() == b'old content'
  assert [p.name for p in path.parent.iterdir()] == ['scores.json']  # no temporary object left
  files.write_atomically(str(path), 'new content')
  assert path.read_text() == 'new content'
  assert [p.name for p in path.parent.iterdir()] == ['scores.json']


@pytest.mark.slow
@pytest.mark.parametrize('case', ['no route', 'unknown host', 'no gcsfs'])
def test_a_bucket_out_of_reach_gets_one_line(case, tmp_path):
  """Else gcsfs retries for ~90 s, logging a traceback at each try, or an ImportError ends it."""
  env = dict(os.environ, STORAGE_EMULATOR_HOST={
      'no route': 'http://127.0.0.1:1', 'unknown host': 'http://storage.invalid'}.get(case, ''))
  if case == 'no gcsfs':  # a gcsfs that fails to import, first on the path
    (tmp_path / 'gcsfs').mkdir()
    (tmp_path / 'gcsfs' / '__init__.py').write_text('raise ImportError("No module named gcsfs")')
    env['PYTHONPATH'] = str(tmp_path)
  why = {'no route': '127.0.0.1:1 cannot be reached (Connection refused)',
         'unknown host': 'storage.invalid:80 cannot be reached (',
         'no gcsfs': "is in a bucket, which needs gcsfs (No module named gcsfs): pip install -e "
                     "'.[gcs]'"}[case]
  for command in (('train.py', '--config=configs/tiny.py', f'--workdir={BUCKET}/run'),
                  ('translate.py', f'--workdir={BUCKET}/run'),
                  ('plot_curves.py', f'--workdir={tmp_path}', f'--workdir={BUCKET}/run'),
                  ('train.py', '--config=configs/tiny.py', f'--workdir={tmp_path}/run',
                   '--config.dataset=text', f'--config.train_files={BUCKET}/{{lang}}.gz')):
    result = run_script(*command, stdin='a\n', env=env)
    given_by = 'config.train_files' if 'train_files' in command[-1] else '--workdir'
    assert error_line(result).startswith(f'{command[0]}: {given_by}: {BUCKET}/'), result.stderr
    assert why in error_line(result), result.stderr
    assert len(result.stderr.strip().splitlines()) < 10, result.stderr  # no gcsfs retries
  assert not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_a_workdir_in_a_bucket_is_held_by_one_run_at_a_time(emulator_env):
  workdir = f'{BUCKET}/runs/held'
  with lock.hold(workdir):
    result = run_script('train.py', '--config=configs/tiny.py', f'--workdir={workdir}',
                        env=emulator_env)
  assert error_line(result).startswith(f'train.py: {workdir} is in use by another run (pid '
                                       f'{os.getpid()} on host {socket.gethostname()}, started ')
  assert not epath.Path(f'{workdir}/{lock.LOCK_FILE}').exists()  # released: removed


@pytest.mark.slow
def test_the_hosts_of_a_multi_host_run_all_stop_on_a_held_bucket_lock(emulator_env):
  workdir = f'{BUCKET}/runs/held_by_two_hosts'
  with lock.hold(workdir):
    first, second = two_hosts_refused(workdir, emulator_env)
  assert first.startswith(f'train.py: {workdir} is in use by another run (pid {os.getpid()} on '
                          f'host {socket.gethostname()}, started ')
  assert second == f'train.py: {workdir} is in use by another run (process 0 says which)'
  for name in (lock.LOCK_FILE, 'config.json'):  # the lock released, nothing written
    assert not epath.Path(f'{workdir}/{name}').exists()


@pytest.mark.slow
def test_a_run_in_a_bucket_trains_resumes_evaluates_translates_and_averages(emulator_env):
  data, workdir = f'{BUCKET}/data', f'{BUCKET}/runs/tiny'
  test_lines = write_texts(data)
  train = ['train.py', '--config=configs/tiny.py', f'--workdir={workdir}',
           '--config.dataset=text', f'--config.train_files={data}/train.{{lang}}.gz',
           f'--config.validation_files={data}/validation.{{lang}}.gz',
           f'--config.test_files={data}/test.{{lang}}.gz', '--config.vocab_size=352',
           '--config.max_length=32', '--config.checkpoint_every_steps=20',
           '--config.eval_every_steps=20', '--config.log_every_steps=20']
  run(emulator_env, *train, '--config.num_train_steps=40')
  for name in ('config.json', 'vocab/sentencepiece.model', 'checkpoints/20', 'checkpoints/40'):
    assert epath.Path(f'{workdir}/{name}').exists(), name
  assert list(epath.Path(f'{workdir}/tensorboard').iterdir())
  assert not epath.Path(f'{workdir}/{lock.LOCK_FILE}').exists()  # released at the end

  # The resumed run goes on from step 40; metrics.jsonl keeps the first run's rows.
  resumed = run(emulator_env, *train, '--config.num_train_steps=60')
  assert 'resumed from step 40' in resumed.stderr
  metrics = rows(f'{workdir}/metrics.jsonl')
  assert [r['step'] for r in metrics if 'split' not in r] == [20, 40, 60]
  evaluations = [r for r in metrics if r.get('split') == 'validation']
  assert [r['step'] for r in evaluations if 'loss' in r] == [20, 40, 60]
  # Each run ends with the BLEU of its last two checkpoints averaged.
  assert [r['checkpoint_steps'] for r in evaluations if 'sacrebleu' in r] == [[20, 40], [40, 60]]

  output = f'{BUCKET}/eval/test'
  run(emulator_env, 'eval.py', f'--workdir={workdir}', '--split=test', f'--output_dir={output}')
  scores = json.loads(epath.Path(f'{output}/scores.json').read_text())
  assert scores['num_sentences'] == 16 and scores['checkpoint_steps'] == [40, 60]
  hypotheses = epath.Path(f'{output}/hypotheses.txt').read_text().splitlines()
  assert len(hypotheses) == 16

  # The translate command gives eval.py's translations (the same checkpoints and beam).
  run(emulator_env, 'translate.py', f'--workdir={workdir}',
      f'--output={BUCKET}/translations.txt', stdin=''.join(f'{line}\n' for line in test_lines))
  assert epath.Path(f'{BUCKET}/translations.txt').read_text().splitlines() == hypotheses

  averaged = f'{BUCKET}/runs/averaged'
  run(emulator_env, 'average_checkpoints.py', f'--workdir={workdir}', '--average_last=2',
      f'--output_dir={averaged}')
  output = f'{BUCKET}/eval/averaged'
  run(emulator_env, 'eval.py', f'--workdir={averaged}', '--split=test', f'--output_dir={output}')
  assert epath.Path(f'{output}/hypotheses.txt').read_text().splitlines() == hypotheses


def test_multi30k_files_in_a_bucket_are_read_and_prepared_on_local_disk(emulator_env, tmp_path):
  files = f'{BUCKET}/multi30k'
  for name in multi30k.FILE_NAMES:  # {prefix}.{lang}.gz: each line names its file and number
    prefix, lang, _ = name.split('.')
    epath.Path(f'{files}/{name}').write_bytes(gzip.compress(''.join(
        f'{prefix} {lang} {number}\n' for number in range(5)).encode()))
  config = multi30k_config.get_config()
  config.update(manual_dir=files, tfds_data_dir=str(tmp_path))
  sources, references = data.split_texts(config, 'validation')
  assert sources == [f'val en {number}' for number in range(5)]
  assert references == [f'val de {number}' for number in range(5)]
  assert list(tmp_path.glob('multi30k_sources/*/multi30k/*/*.array_record*'))
