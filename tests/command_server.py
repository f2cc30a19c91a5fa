"""The repository's commands (`python eval.py ...`) run in a process forked from one that has
imported their libraries already: a command's start is then a fork, not the seconds its imports
take (JAX, Flax, Orbax, TFDS, ...), and it runs as `python SCRIPT` would, in a process of its own.

`CommandServer.run` sends a request to the server (this file run as a script), which forks a child
for it and reports the child's exit status; the child takes the request's environment, working
directory, standard streams and file size limit, then runs the script as `__main__` at the top
level, where an uncaught exception prints its traceback and the interpreter ends as usual.
"""

import json
import os
import select
import signal
import subprocess
import sys

# What the commands import, but for the modules that define absl flags (transformer/translate.py
# and those importing it), which a child's second definition would clash with.
PRELOADED = ('jax', 'flax.linen', 'optax', 'orbax.checkpoint', 'tensorflow_datasets',
             'sentencepiece', 'sacrebleu', 'sacremoses', 'configs.default', 'transformer.bleu',
             'transformer.checkpoints', 'transformer.commands', 'transformer.data',
             'transformer.decode', 'transformer.marian', 'transformer.metrics',
             'transformer.sampling', 'transformer.stored_config', 'transformer.train_step')


class CommandServer:
  """A server process started with `env` (JAX reads its variables when it is imported), whose
  children run commands."""

  def __init__(self, env: dict[str, str], cwd: str):
    self.env, self.cwd = env, cwd
    self.process = subprocess.Popen([sys.executable, __file__], cwd=cwd, env=env, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)

  def run(self, args: list[str], env: dict[str, str], stdin_path: str, stdout_path: str,
          stderr_path: str, max_file_bytes: int | None, timeout: float) -> int:
    """The exit status of `python ARGS` (negative: the signal that ended it), its standard
    streams from and to the files named.

    Raises:
      subprocess.TimeoutExpired: it ran past `timeout` seconds, and was killed.
    """
    request = dict(args=args, env=env, cwd=self.cwd, stdin=stdin_path, stdout=stdout_path,
                   stderr=stderr_path, max_file_bytes=max_file_bytes)
    self.process.stdin.write(json.dumps(request) + '\n')
    self.process.stdin.flush()
    pid = json.loads(self.process.stdout.readline())['pid']
    ready, _, _ = select.select([self.process.stdout], [], [], timeout)
    if not ready:
      os.kill(pid, signal.SIGKILL)
      self.process.stdout.readline()
      raise subprocess.TimeoutExpired(args, timeout)
    return json.loads(self.process.stdout.readline())['status']

  def close(self):
    self.process.stdin.close()
    self.process.wait()


def _serve() -> dict:
  """Forks a child per request until the input ends; returns the request in the child."""
  for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
      return request
    print(json.dumps({'pid': pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({'status': os.waitstatus_to_exitcode(status)}), flush=True)
  sys.exit(0)


if __name__ == '__main__':
  import importlib
  import resource
  import runpy
  sys.path[0] = os.getcwd()  # the repository's root, as for its scripts
  for _module in PRELOADED:
    importlib.import_module(_module)
  _request = _serve()
  # The child: the command's own process from here on.
  os.environ.clear()
  os.environ.update(_request['env'])
  os.chdir(_request['cwd'])
  for _fd, _path, _flags in ((0, _request['stdin'], os.O_RDONLY),
                             (1, _request['stdout'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                             (2, _request['stderr'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    _opened = os.open(_path, _flags)
    os.dup2(_opened, _fd)
    os.close(_opened)
  if _request['max_file_bytes'] is not None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (_request['max_file_bytes'],) * 2)
  _args = _request['args']
  del _request, _fd, _path, _flags, _opened, _module
  if _args[0] == '-m':
    sys.argv = _args[1:]
    runpy.run_module(_args[1], run_name='__main__', alter_sys=True)
  else:
    sys.argv = _args
    runpy.run_path(_args[0], run_name='__main__')
