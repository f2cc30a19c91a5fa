"""What the commands (train.py, eval.py, translate.py, ...) do around the library: read their
flags, with the --config file flag's mistakes as one line, set up JAX for the run (its XLA flags,
its compilation cache, its backend), and end a Ctrl-C or a SIGTERM in one line. The library itself
touches none of these.
"""

import contextlib
import os
import re
import subprocess
import sys
import traceback

import jax
import ml_collections
from absl import app, flags, logging
from jax._src import xla_bridge  # backends_are_initialized: jax has no public check

from transformer import files, interrupts
from transformer import stored_config
from transformer.config import ConfigError


def use_compilation_cache(config: ml_collections.ConfigDict):
  """Keeps every compiled program in config.compilation_cache_dir, if set, for later runs.

  Raises:
    files.DirectoryError: it cannot be a directory, or takes no new file (JAX would warn at every
      program and keep none).
  """
  if config.compilation_cache_dir:
    path = os.path.expanduser(config.compilation_cache_dir)
    files.check_writable(os.path.join(path, 'program'), 'config.compilation_cache_dir')
    jax.config.update('jax_compilation_cache_dir', path)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)


def _xla_rejects(xla_flags: list[str]) -> str:
  """Why XLA rejects one of `xla_flags` (a flag it does not know or a value it cannot read), or ''.

  XLA reads XLA_FLAGS once, and on such a flag ends the process with a fatal log (for a bad value,
  after printing every flag it has): jaxlib reads them first in a subprocess, which costs a
  fraction of a second.
  """
  result = subprocess.run(
      [sys.executable, '-c', 'from jaxlib import _jax; _jax.CompileOptions()'],
      env={**os.environ, 'XLA_FLAGS': ' '.join(xla_flags)}, capture_output=True, text=True,
      check=False)
  if result.returncode == 0:
    return ''
  reasons = [line.split('] ', 1)[-1].rstrip('.') for line in result.stderr.splitlines()
             if 'Unknown flag in XLA_FLAGS' in line or "Couldn't interpret value" in line]
  if not reasons:  # not XLA's flag parsing: jaxlib itself failed, unrelated to the flags
    logging.warning('XLA_FLAGS not checked: %s', result.stderr.strip()[-300:])
    return ''
  return reasons[0]


def use_xla_flags(config: ml_collections.ConfigDict):
  """Adds config.xla_flags to the XLA_FLAGS environment variable, which XLA reads when JAX starts
  its backend: call it before anything runs on a device. A flag XLA_FLAGS already names keeps
  the environment's value.

  Raises:
    ConfigError: XLA does not know one of the flags (config.xla_flags' or the environment's), or
      cannot read its value.
  """
  current = os.environ.get('XLA_FLAGS', '').split()
  named = {flag.split('=')[0] for flag in current}
  missing = [flag for flag in config.xla_flags.split() if flag.split('=')[0] not in named]
  if not current + missing:
    return
  if reason := _xla_rejects(current + missing):
    flag = re.search(r'xla_\w+', reason)
    if flag and f'--{flag[0]}' in named:
      raise ConfigError(f'the environment variable XLA_FLAGS={" ".join(current)!r}: XLA rejects '
                        f'it ({reason}); mend or unset XLA_FLAGS')
    raise ConfigError(
        f'config.xla_flags={config.xla_flags!r}: XLA rejects it ({reason}); see '
        '`XLA_FLAGS=--help python -c "import jax; jax.devices()"` for the flags this jaxlib '
        'knows', 'xla_flags')
  if not missing:
    return
  if xla_bridge.backends_are_initialized():
    logging.warning('config.xla_flags %s not applied: JAX started its backend before; set '
                    'XLA_FLAGS before the process starts', ' '.join(missing))
    return
  os.environ['XLA_FLAGS'] = ' '.join(current + missing)


def parse_flags(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS,
                name: str = 'config') -> list[str]:
  """absl's parsing of `argv` into `flag_values`, whose `--{name}` is an ml_collections config
  file flag. ml_collections reports a missing file, a file that is no config (a syntax error, a
  failed import, no get_config, which returns no ConfigDict), an argument its get_config rejects,
  or an unknown --{name}.key as a traceback; each raises one ConfigError naming the flag
  instead."""
  overrides = [arg for arg in argv[1:] if arg.startswith(f'--{name}.')]
  value = next((arg for arg in argv[1:] if arg.startswith(f'--{name}=')), f'--{name}')
  example = 'def get_config() returning an ml_collections.ConfigDict, as configs/tiny.py does'
  try:
    remaining = flag_values(argv)
    config = flag_values[name].value  # ml_collections defers a failed load to here
  except OSError as error:  # the file is missing: the message ends with the path tried
    raise ConfigError(f'{value}: {str(error).strip().splitlines()[-1].strip()}') from None
  except SyntaxError as error:
    raise ConfigError(f'{value}: line {error.lineno}: {error.msg}; a config file is Python with '
                      f'{example}') from None
  except ImportError as error:  # what the file imports
    raise ConfigError(f'{value}: {error}; install it, or drop the import') from None
  except flags.Error as error:
    if 'Error whilst parsing config file' not in str(error):
      raise
    # The last line of the traceback ml_collections puts in the message: get_config's exception.
    problem = str(error).strip().splitlines()[-1].split(': ', 1)[-1]
    raise ConfigError(problem if value.split('=', 1)[-1] in problem else
                      f'{value}: {problem}') from None
  except (KeyError, AttributeError) as error:
    if "no attribute 'get_config'" in str(error):
      raise ConfigError(f'{value}: the file has no get_config(); give it {example}') from None
    while error.args and isinstance(error.args[0], BaseException):  # AttributeError(KeyError)
      error = error.args[0]
    key, _, did_you_mean = str(error.args[0] if error.args else error).partition('\n')
    key = key.strip("'")
    override = next((arg for arg in overrides
                     if key in arg.split('=', 1)[0].split('.')), ' '.join(overrides))
    problem = f'no key {key!r} in the config' if key.isidentifier() else key
    raise ConfigError(f'{override}: {problem}. {did_you_mean}'.strip()) from None
  except Exception as error:  # the file's own code raised, at import or in get_config
    path = os.path.abspath(value.split('=', 1)[-1].split(':', 1)[0])
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if os.path.abspath(frame.filename) == path]
    where = f'line {lines[-1]}: ' if lines else ''
    raise ConfigError(f'{value}: {where}{type(error).__name__}: {error}') from None
  if config is not None and not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'{value}: get_config() returned {config!r:.40}, not a ConfigDict; give the '
                      f'file {example}')
  return remaining


def flags_parser(command: str):
  """An absl `flags_parser` for `command` (e.g. 'train.py'): `parse_flags`, and a bad --config
  ends the command with one line, `<command>: <what is wrong>`."""
  def parse(argv: list[str]) -> list[str]:
    try:
      return parse_flags(argv)
    except (ConfigError, flags.Error) as error:
      sys.exit(f'{command}: {error}')
  return parse


def _paths(name: str, value):
  """(the flag or key, the value) of each string in a flag's value: a list's (a repeated flag),
  a config's keys'."""
  if isinstance(value, (ml_collections.ConfigDict, dict)):
    for key, item in value.items():
      yield from _paths(f'{name.lstrip("-")}.{key}', item)
  elif isinstance(value, (list, tuple)):
    for item in value:
      yield from _paths(name, item)
  elif isinstance(value, str):
    yield name, value


def check_buckets(flag_values: flags.FlagValues = flags.FLAGS):
  """`files.check_bucket` for each gs:// path the command was given, in a flag or in its config:
  one line within seconds where the bucket cannot be reached."""
  for name, value in flag_values.flag_values_dict().items():
    for given_by, path in _paths(f'--{name}', value):
      files.check_bucket(path, given_by)


def run(main, command: str, config_flag: bool = False):
  """absl's `app.run(main)` for `command` (e.g. 'eval.py'): a Ctrl-C, a SIGTERM or a SIGHUP ends
  it at once in one line (`interrupts.end_at_once`, which the command's script starts before its
  imports), the files it was writing left as they were; train.py's loop saves first. With
  `config_flag`, a bad --config ends it with one line too (`flags_parser`), and so does a bucket
  out of reach (`check_buckets`)."""
  interrupts.end_at_once(command)

  def checked(argv):
    try:
      check_buckets()
    except files.DirectoryError as error:  # a bucket out of reach
      sys.exit(f'{command}: {error}')
    return main(argv)
  app.run(checked, **({'flags_parser': flags_parser(command)} if config_flag else {}))


def start_backend():
  """Starts JAX's backend now, so that a platform it cannot start here (JAX_PLATFORMS=tpu on a
  machine without one, cuda without JAX's CUDA plugin) ends the command in one line.

  Raises:
    ConfigError: it cannot start; the message names JAX_PLATFORMS and the fix.
  """
  try:
    jax.devices()
  except (RuntimeError, AssertionError) as error:  # AssertionError: a platform no plugin provides
    why = (str(error).split(' (set JAX_PLATFORMS')[0].rstrip('.') or
           'no installed plugin provides it')
    platforms = jax.config.jax_platforms
    raise ConfigError(
        f'JAX cannot start its backend{f" for JAX_PLATFORMS={platforms}" if platforms else ""} '
        f'({why}): unset JAX_PLATFORMS to use the devices this machine has, or install jax for '
        "the device (pip install -e '.[cuda12]' or '.[tpu]')") from None


def set_up_jax(config: ml_collections.ConfigDict, workdir: str = '', start: bool = True):
  """Applies config.xla_flags and config.compilation_cache_dir, then starts JAX's backend
  (`start_backend`) unless `start` is False (train.py joins the other hosts first).
  `config` is the config.json of the run in `workdir`, if given, and errors say so.

  Raises:
    ConfigError: XLA rejects one of the flags, or JAX cannot start.
    files.DirectoryError: the cache cannot be a directory.
  """
  with stored_config.fixes_in_run_config(workdir) if workdir else contextlib.nullcontext():
    use_xla_flags(config)
  use_compilation_cache(config)
  if start:
    start_backend()
