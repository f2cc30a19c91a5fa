"""The commands' set-up: their flags, the --config file flag's mistakes as one line, and JAX's
XLA flags and compilation cache from the config."""

import os
import re
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from configs import multi30k, tiny
from transformer import commands
from transformer import config as config_lib
from transformer.files import DirectoryError

from conftest import ROOT, error_line, run_script


@pytest.mark.slow
@pytest.mark.parametrize('script,flag_names', [
    ('train.py', ['--config', '--workdir', '--coordinator_address', '--num_processes',
                  '--process_id']),
    ('eval.py', ['--workdir', '--split', '--source_file', '--reference_file', '--average_last',
                 '--up_to_step', '--beam_size', '--alpha', '--output_dir']),
    ('average_checkpoints.py', ['--workdir', '--average_last', '--up_to_step', '--output_dir']),
])
def test_entry_points_print_help(script, flag_names):
  result = run_script(script, '--help')
  assert result.returncode == 1 and not result.stderr  # absl's --help exits with status 1
  for flag in flag_names:
    assert flag + ':' in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize('override,message', [
    ('--config.model.num_heads=3', 'config.model.num_heads=3: model.d_model=32 must be divisible'),
    ('--config.model.num_haeds=3', "--config.model.num_haeds=3: no key 'num_haeds' in the config. "
                                   'Did you mean "num_heads" instead of "num_haeds"?'),
])
def test_train_py_reports_a_bad_override_in_one_line(override, message):
  result = run_script('train.py', '--config=configs/tiny.py', '--workdir=unused', override)
  assert result.returncode != 0
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith(f'train.py: {message}')


MULTI_HOST = ('--num_processes=1', '--process_id=0')


@pytest.mark.parametrize('script,args,line', [
    ('train.py', ('--num_processes=2',),
     '--coordinator_address, --num_processes and --process_id go together'),
    ('train.py', ('--coordinator_address=localhost:1234', '--num_processes=0', '--process_id=0'),
     '--num_processes=0 must be >= 1'),
    ('train.py', ('--coordinator_address=localhost:1234', '--num_processes=2', '--process_id=2'),
     '--process_id=2 must be in [0, --num_processes=2)'),
    ('train.py', ('--coordinator_address=localhost', *MULTI_HOST),
     '--coordinator_address=localhost must be HOST:PORT of process 0, e.g. 10.0.0.1:1234'),
    ('train.py', ('--coordinator_address=localhost:99999', *MULTI_HOST),
     '--coordinator_address=localhost:99999 must be HOST:PORT of process 0, e.g. 10.0.0.1:1234'),
    # .invalid never resolves (RFC 6761): without the check JAX waits 5 minutes, then aborts.
    ('train.py', ('--coordinator_address=coordinator.invalid:1234', *MULTI_HOST),
     '--coordinator_address=coordinator.invalid:1234: host coordinator.invalid is unknown ('),
    ('eval.py', ('--beam_size=0',),
     'FATAL Flags parsing error: flag --beam_size=0: 0 is not a positive integer'),
    ('eval.py', ('--alpha=-0.5',), 'FATAL Flags parsing error: flag --alpha=-0.5: must be a '
                                   'finite number >= 0 (0: no length penalty)'),
    ('translate.py', ('--alpha=nan',), 'FATAL Flags parsing error: flag --alpha=nan: must be a '
                                       'finite number >= 0 (0: no length penalty)'),
    ('translate.py', ('--sampling=topp', '--top_p=0'),
     'FATAL Flags parsing error: flag --top_p=0.0: must be in (0, 1]'),
    ('translate.py', ('--sampling=topp', '--top_p=1.5'),
     'FATAL Flags parsing error: flag --top_p=1.5: must be in (0, 1]'),
    ('translate.py', ('--sampling=topk', '--temperature=-0.1'), 'FATAL Flags parsing error: flag '
     '--temperature=-0.1: must be a finite number >= 0 (0: greedy search)'),
    ('translate.py', ('--nbest=0',),
     'FATAL Flags parsing error: flag --nbest=0: 0 is not a positive integer'),
    ('translate.py', ('--sampling=top',), 'FATAL Flags parsing error: flag --sampling=top: value '
     'should be one of <greedy|topk|topp>'),
    ('score.py', ('--up_to_step=-1',),
     'FATAL Flags parsing error: flag --up_to_step=-1: -1 is not a non-negative integer'),
])
@pytest.mark.slow
def test_commands_report_bad_flags_in_one_line(script, args, line, tmp_path):
  required = {'train.py': ('--config=configs/tiny.py', f'--workdir={tmp_path}'),
              'eval.py': (f'--workdir={tmp_path}', f'--output_dir={tmp_path}'),
              'translate.py': (f'--workdir={tmp_path}',),
              'score.py': (f'--workdir={tmp_path}', '--source_file=S', '--target_file=T')}[script]
  result = run_script(script, *required, *args)
  assert result.returncode != 0 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  # absl's flag errors end with a line pointing to --helpshort.
  assert any(found.startswith(line) for found in result.stderr.strip().splitlines()[-2:]), (
      result.stderr[-3000:])


def parse_config_flag(*args):
  argv = ['train.py', *args]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  assert commands.parse_flags(argv, flag_values) == ['train.py']
  return flag_values.config


@pytest.mark.parametrize('args,message', [
    (['--config=configs/multi30k.py', '--config.model.d_modl=3'],
     '--config.model.d_modl=3: no key \'d_modl\' in the config. Did you mean "d_model" instead of '
     '"d_modl"?'),
    (['--config=configs/multi30k.py', '--config.vocab_size=8000', '--config.modl.d_ff=3'],
     "--config.modl.d_ff=3: no key 'modl' in the config. "
     'Did you mean "model" instead of "modl"?'),
    (['--config=configs/multi30k.py:ende'],
     "configs/multi30k.py:ende: the argument is a language pair such as 'en-de' or 'en-fr', or "
     "several joined by '+' (one model for all)"),
    (['--config=configs/default.py:big'],
     '--config=configs/default.py:big: get_config() takes 0 positional arguments but 1 was given'),
    (['--config=configs/multi3k.py', '--config.seed=1'],
     "--config=configs/multi3k.py: [Errno 2] No such file or directory: 'configs/multi3k.py'"),
])
def test_config_flag_mistakes_are_one_line(monkeypatch, args, message):
  monkeypatch.chdir(ROOT)
  with pytest.raises(config_lib.ConfigError) as error:
    parse_config_flag(*args)
  assert str(error.value) == message


@pytest.mark.slow
@pytest.mark.parametrize('text,message', [
    ('def get_config(:\n  pass\n', 'line 1: invalid syntax; a config file is Python with '),
    ('import no_such_module\n', "No module named 'no_such_module'; install it, or drop the "
                                 'import'),
    ('x = 1\n', 'the file has no get_config(); give it '),
    ('def get_config():\n  return 3\n', 'get_config() returned 3, not a ConfigDict; give the '
                                        'file '),
    ('x = 1 / 0\n', 'line 1: ZeroDivisionError: division by zero'),
    ('def get_config():\n  raise RuntimeError("no data")\n', 'line 2: RuntimeError: no data'),
])
def test_a_config_file_that_is_no_config_is_named_with_its_line(tmp_path, text, message):
  path = tmp_path / 'config.py'
  path.write_text(text, encoding='utf-8')
  result = run_script('train.py', f'--config={path}', f'--workdir={tmp_path}/run')
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  line = result.stderr.strip().splitlines()[-1]
  assert line.startswith(f'train.py: --config={path}: {message}')
  if 'a config file' in message or 'give' in message:
    assert line.endswith('def get_config() returning an ml_collections.ConfigDict, as '
                         'configs/tiny.py does')
  assert os.listdir(tmp_path) == ['config.py']


def test_config_flag_argument_and_overrides_parse(monkeypatch):
  monkeypatch.chdir(ROOT)
  config = parse_config_flag('--config=configs/multi30k.py:en-fr', '--config.model.d_ff=768')
  assert (config.target_lang, config.model.d_ff) == ('fr', 768)


@pytest.mark.parametrize('xla_flags, reason', [
    ('--xla_gpu_autotune_level=2 --xla_no_such_flag=1',
     'Unknown flag in XLA_FLAGS: --xla_no_such_flag=1'),
    ('--xla_gpu_autotune_level=high', "Couldn't interpret value high for flag "
     'xla_gpu_autotune_level'),
    ('--xla_gpu_enable_triton_gemm=no', "Couldn't interpret value no for flag "
     'xla_gpu_enable_triton_gemm'),
])
def test_xla_flags_that_xla_rejects_fail_as_one_config_error(xla_flags, reason, monkeypatch):
  # Put in XLA_FLAGS, they would end the process when JAX starts its backend.
  config = tiny.get_config()
  config.xla_flags = xla_flags
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=4')
  with pytest.raises(config_lib.ConfigError) as error:
    commands.use_xla_flags(config)
  assert str(error.value).startswith(f'config.xla_flags={xla_flags!r}: XLA rejects it ({reason})')
  assert os.environ['XLA_FLAGS'] == '--xla_force_host_platform_device_count=4'


@pytest.mark.slow
@pytest.mark.parametrize('environment,reason', [
    ('--xla_force_host_platform_device_count=2 --xla_cpu_enable_fast_math=maybe',
     "Couldn't interpret value maybe for flag xla_cpu_enable_fast_math"),
    ('--xla_no_such_flag=1', 'Unknown flag in XLA_FLAGS: --xla_no_such_flag=1'),
])
def test_an_environments_xla_flags_that_xla_rejects_get_one_line(environment, reason, tmp_path):
  # Else XLA ends the process as JAX starts, a bad value after printing all of its ~90 flags.
  result = subprocess.run(
      [sys.executable, 'train.py', '--config=configs/tiny.py', f'--workdir={tmp_path}/run'],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, XLA_FLAGS=environment))
  assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert result.stderr.strip() == (f'train.py: the environment variable XLA_FLAGS={environment!r}: '
                                   f'XLA rejects it ({reason}); mend or unset XLA_FLAGS')
  assert os.listdir(tmp_path) == []


def test_xla_flags_go_unchecked_with_a_warning_where_jaxlib_cannot_check_them(monkeypatch,
                                                                            caplog):
  config = tiny.get_config()
  config.xla_flags = '--xla_gpu_autotune_level=2'
  failed = subprocess.CompletedProcess([], 1, '',
                                      "ModuleNotFoundError: No module named 'jaxlib._jax'")
  monkeypatch.setattr(commands.subprocess, 'run', lambda *args, **kwargs: failed)
  monkeypatch.setattr(commands.xla_bridge, 'backends_are_initialized', lambda: False)
  monkeypatch.delenv('XLA_FLAGS', raising=False)
  commands.use_xla_flags(config)
  assert os.environ['XLA_FLAGS'] == '--xla_gpu_autotune_level=2'
  assert "XLA_FLAGS not checked: ModuleNotFoundError: No module named 'jaxlib._jax'" in (
      caplog.text)


def test_xla_flags_join_the_environments_which_keeps_its_own_values(monkeypatch, caplog):
  config = multi30k.get_config()
  config.xla_flags = '--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=2'
  monkeypatch.setattr(commands.xla_bridge, 'backends_are_initialized', lambda: False)
  monkeypatch.delenv('XLA_FLAGS', raising=False)
  commands.use_xla_flags(config)
  assert os.environ['XLA_FLAGS'] == config.xla_flags
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=4 '
                     '--xla_gpu_autotune_level=4')
  commands.use_xla_flags(config)
  assert os.environ['XLA_FLAGS'] == ('--xla_force_host_platform_device_count=4 '
                                     '--xla_gpu_autotune_level=4 '
                                     '--xla_gpu_enable_triton_gemm=false')
  # Once the backend runs, XLA no longer reads them: said, and the environment left alone.
  monkeypatch.setattr(commands.xla_bridge, 'backends_are_initialized', lambda: True)
  monkeypatch.setenv('XLA_FLAGS', '')
  commands.use_xla_flags(config)
  assert os.environ['XLA_FLAGS'] == ''
  assert 'config.xla_flags --xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=2 not ' \
      'applied' in caplog.text


@pytest.mark.slow
def test_a_compilation_cache_that_cannot_be_a_directory_is_named(tmp_path):
  file = tmp_path / 'file'
  file.write_text('', encoding='utf-8')
  config = tiny.get_config()
  config.compilation_cache_dir = f'{file}/jax'
  with pytest.raises(DirectoryError, match=re.escape(
      f'config.compilation_cache_dir: {file}/jax cannot be made a directory (Not a directory)')):
    commands.use_compilation_cache(config)
  assert os.listdir(tmp_path) == ['file']
  # /sys: read-only, even for root.
  result = run_script('train.py', '--config=configs/tiny.py', f'--workdir={tmp_path}/run',
                      '--config.compilation_cache_dir=/sys')
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      'train.py: config.compilation_cache_dir: /sys takes no new file (Permission denied); give a '
      'directory you can write to')
  assert os.listdir(tmp_path) == ['file']


@pytest.mark.slow
def test_a_command_forked_by_the_tests_ends_as_in_a_process_of_its_own(tmp_path):
  """The tests' run_script forks a command from a process with its libraries imported
  (command_server.py): it ends as `python SCRIPT` started afresh does."""
  args = ('eval.py', f'--workdir={tmp_path}/absent', f'--output_dir={tmp_path}/out')
  forked = run_script(*args, stdin='a\n')
  fresh = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         input='a\n', timeout=300)
  assert forked.returncode == fresh.returncode == 1
  assert error_line(forked) == error_line(fresh) == (
      f'eval.py: {tmp_path}/absent/config.json not found: --workdir must be a directory train.py '
      'wrote')
