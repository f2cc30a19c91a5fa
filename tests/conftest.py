"""Test session set-up: four simulated CPU devices (as on 4 chips), one compilation cache, one
prepared-data directory, where Multi30k is, and a trained tiny run for the tests of what reads one."""

import atexit
import fcntl
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

# Must happen before JAX starts; the tests that need one device take the first one.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=4').strip()
# One compilation cache for the session and the train.py/eval.py runs it starts: runs of one config
# compile the same programs, so each is compiled once (a tiny train.py run takes half the time).
# Prepared data (datasets, vocabularies, token ids) in one place per session too, away from the
# user's ~/tensorflow_datasets: tests that train the same vocabulary share it, as runs do. Each
# pytest-xdist worker gets directories of its own: JAX and TFDS write their files in place, so
# processes running at once must not share them. Directories the caller set up are used as they are.
_OWN_DIRS = 'TRANSFORMER_TESTS_OWN_DIRS'  # marks directories made here (and inherited by workers)
for _variable, _prefix in (('JAX_COMPILATION_CACHE_DIR', 'jax_compilation_cache_'),
                           ('TFDS_DATA_DIR', 'tfds_data_dir_')):
  if _variable not in os.environ or _OWN_DIRS in os.environ:
    os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
    atexit.register(shutil.rmtree, os.environ[_variable], ignore_errors=True)
    if _variable == 'JAX_COMPILATION_CACHE_DIR':
      os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ[_OWN_DIRS] = '1'

# After the set-up above: JAX and TFDS read it when first imported.
from configs import tiny  # pylint: disable=wrong-import-position
import command_server  # pylint: disable=wrong-import-position
from transformer import trainer  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='session')
def multi30k_dir() -> str:
  """The Multi30k files (MULTI30K_DIR, default ../shared/data/multi30k); required when CI=true."""
  path = os.path.join(ROOT, os.environ.get('MULTI30K_DIR', os.path.join('..', 'shared', 'data',
                                                                         'multi30k')))
  if not os.path.isfile(os.path.join(path, 'train.en.gz')):
    message = f'Multi30k not found in {path} (set MULTI30K_DIR)'
    if os.environ.get('CI') == 'true':
      pytest.fail(message)
    pytest.skip(message)
  return path


@pytest.fixture
def float32_matmuls():
  """Float32's matmuls in float32 on a GPU too, where XLA's default rounds their operands to
  TensorFloat-32: for tests that compare two float32 computations closer than that rounding."""
  with jax.default_matmul_precision('highest'):
    yield


def run_script(*args, stdin: str | bytes | None = None, timeout: float = 600,
               env: dict[str, str] | None = None,
               max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
  """`python ARGS` in the repository root, on two simulated devices (unless `env` sets
  XLA_FLAGS), with the variables of `env` set (None: unset), and no file it writes over
  `max_file_bytes` (as on a full disk); its output as text. A script of the repository's, or
  `-m module`, in this environment but for XLA_FLAGS runs forked from a process with its
  libraries imported (command_server.py)."""
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=2', **(env or {})}
  env = {name: value for name, value in env.items() if value is not None}
  stdin = stdin.encode() if isinstance(stdin, str) else stdin
  script = args[1] if args[0] == '-m' else args[0]
  if (args[0] == '-m' or script.endswith('.py')) and script not in _SETS_UP_JAX:
    return _forked(list(args), stdin, timeout, env, max_file_bytes)
  limit = None if max_file_bytes is None else (
      lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes)))
  result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          input=stdin, timeout=timeout, preexec_fn=limit)
  return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(),
                                     result.stderr.decode())


# Commands that set JAX's variables before they import it, which a forked process has done.
_SETS_UP_JAX = ('tpu_plan.py', 'benchmarks.gpu_plan')
# CommandServers by their environment but for XLA_FLAGS (read when JAX starts its backend, the
# rest when a library is imported), the last used last; the two last used are kept.
_servers: dict[tuple, command_server.CommandServer] = {}


def _forked(args, stdin, timeout, env, max_file_bytes) -> subprocess.CompletedProcess:
  key = tuple(sorted((name, value) for name, value in env.items() if name != 'XLA_FLAGS'))
  server = _servers.pop(key, None) or command_server.CommandServer(dict(key), ROOT)
  _servers[key] = server
  while len(_servers) > 2:
    _servers.pop(next(iter(_servers))).close()
  with tempfile.TemporaryDirectory() as streams:
    paths = [os.path.join(streams, name) for name in ('stdin', 'stdout', 'stderr')]
    with open(paths[0], 'wb') as f:
      f.write(stdin or b'')
    status = server.run(args, env, *paths, max_file_bytes, timeout)
    output = []
    for path in paths[1:]:
      with open(path, 'rb') as f:
        output.append(f.read().decode())
  return subprocess.CompletedProcess([sys.executable, *args], status, *output)


@atexit.register
def _close_servers():
  for server in _servers.values():
    server.close()


def popen_as_from_a_terminal(command: list[str], **kwargs) -> subprocess.Popen:
  """subprocess.Popen(command, **kwargs) with Ctrl-C (SIGINT) and SIGHUP the child's defaults: a
  suite started as a background job ignores SIGINT, one under nohup SIGHUP (and a library of the
  suite's may have ignored it), and an ignored signal stays ignored in a child, where a handled
  one is the default again."""
  before = {signum: signal.signal(signum, signal.default_int_handler)
            for signum in (signal.SIGINT, signal.SIGHUP)}
  try:
    return subprocess.Popen(command, **kwargs)
  finally:
    for signum, handler in before.items():
      signal.signal(signum, handler)


def error_line(result: subprocess.CompletedProcess) -> str:
  """The last stderr line of a command that failed with a message, not a traceback."""
  assert result.returncode != 0 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  return result.stderr.strip().splitlines()[-1]


def train_in_process(workdir: str, **overrides) -> str:
  """trainer.train on configs/tiny.py with `overrides` ('model.d_ff': 128, ...), in this process,
  on its four devices; what it logged, a message per line."""
  config = tiny.get_config()
  config.update_from_flattened_dict(overrides)
  messages = []
  handler = logging.Handler(logging.INFO)
  handler.emit = lambda record: messages.append(record.getMessage())
  logger = logging.getLogger('absl')
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  try:
    trainer.train(config, workdir)
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  return '\n'.join(messages)


def built_once(tmp_path_factory, name: str, build) -> str:
  """The directory `name` that `build(path)` fills once for the whole session, whose
  pytest-xdist workers share it: the first to ask builds it while the others wait, and each uses
  it as it is (a test that changes it works on a copy)."""
  root = tmp_path_factory.getbasetemp()
  if 'PYTEST_XDIST_WORKER' in os.environ:  # each worker's base is in the session's
    root = root.parent
  path, done = root / name, root / f'{name}.built'
  with open(root / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when its process ends
    if not done.exists():
      shutil.rmtree(path, ignore_errors=True)  # what a build that failed left
      path.mkdir()
      build(str(path))
      done.touch()
  return str(path)


@pytest.fixture(scope='session')
def tiny_run(tmp_path_factory) -> str:
  """configs/tiny.py trained 100 steps, keeping the checkpoints of steps 50, 75 and 100."""
  return built_once(tmp_path_factory, 'tiny_run', lambda path: train_in_process(
      path, checkpoint_every_steps=25, keep_checkpoints=3))
