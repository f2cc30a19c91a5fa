"""Training end to end on configs/tiny.py: outputs, resume, preemption, NaN, several hosts.

trainer.train runs in this process (on its four devices) except where a separate process is the
point: a SIGTERM, another device count, several hosts, train.py's own error lines."""

import asyncio
import gc
import json
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import jax_utils
from tensorboardX.proto import event_pb2

from conftest import error_line, popen_as_from_a_terminal, run_script, train_in_process
from configs import tiny
from transformer import config as config_lib
from transformer import data, evaluator, lock, metrics, train_step, trainer
from transformer.kernels import choice, compile_ahead, packing
from transformer.checkpoints import CheckpointError, Checkpoints, load_params
from transformer.checkpoints import layout as checkpoint_layout
from transformer.files import DirectoryError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(devices: int | None, compilation_cache: bool = True) -> dict:
  """The environment of a train.py process on `devices` CPU devices (None: no XLA_FLAGS)."""
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')
  if devices is None:
    del env['XLA_FLAGS']
  env.pop('JAX_PLATFORMS', None)
  if not compilation_cache:  # processes running at once could read each other's half-written files
    env.pop('JAX_COMPILATION_CACHE_DIR', None)
  return env


# The overrides of a run whose test checks no evaluation: no validation loss on the way, no
# closing BLEU (a beam search to compile, two splits to translate).
NO_EVALUATION = {'eval_every_steps': 0, 'final_bleu_splits': ''}
NO_EVALUATION_FLAGS = tuple(f'--config.{key}={value}' for key, value in NO_EVALUATION.items())


def train_command(workdir, *overrides):
  return [sys.executable, os.path.join(ROOT, 'train.py'), '--config=configs/tiny.py',
          f'--workdir={workdir}', *overrides]


def run_train(workdir, *overrides, devices=4, expect_ok=True, max_file_bytes=None):
  result = run_script(*train_command(workdir, *overrides)[1:], max_file_bytes=max_file_bytes, env={
      'XLA_FLAGS': None if devices is None else f'--xla_force_host_platform_device_count={devices}',
      'JAX_PLATFORMS': None})
  if expect_ok:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def restore(workdir, step):
  config = tiny.get_config()
  state = train_step.initial_state(config)
  checkpoints = Checkpoints(workdir)
  tree, meta = checkpoints.restore(step, {'params': state.params, 'opt_state': state.opt_state})
  checkpoints.close()
  return tree, meta


def max_difference(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                          jax.tree_util.tree_leaves(b)))


@pytest.fixture(scope='module')
def full_run(tmp_path_factory):
  """100 steps of configs/tiny.py in one go (checkpoints at 50 and 100)."""
  workdir = str(tmp_path_factory.mktemp('full'))
  compile_program, lower = compile_ahead.Programs._compile, compile_ahead.Programs.lower
  compile_ahead_fn = evaluator.Evaluator.compile_ahead
  train_step_fn = train_step.StepFunctions.train_step
  steps_run = []

  class CountedOptimizerStep(trainer._OptimizerStep):
    def __call__(self, *args):
      result = super().__call__(*args)
      steps_run.append(1)
      return result

  with pytest.MonkeyPatch.context() as patch:  # notes which thread compiled each program, when
    patch.setattr(compile_ahead.Programs, '_compile',
                  lambda programs, key, args: COMPILED_ON.append(
                      (programs.pmapped.__name__, threading.current_thread().name,
                       len(steps_run))) or compile_program(programs, key, args))
    patch.setattr(compile_ahead.Programs, 'lower', lambda programs, *args: LOWERED_AFTER.append(
        len(steps_run)) or lower(programs, *args))
    patch.setattr(trainer, '_OptimizerStep', CountedOptimizerStep)
    patch.setattr(evaluator.Evaluator, 'compile_ahead', lambda *args: STEPS_BEFORE_COMPILE_AHEAD
                  .append(len(steps_run)) or TRACES_BEFORE_COMPILE_AHEAD.append(
                      len(TRAIN_STEP_TRACES)) or compile_ahead_fn(*args))
    patch.setattr(train_step.StepFunctions, 'train_step', lambda *args: TRAIN_STEP_TRACES.append(
        threading.current_thread().name) or train_step_fn(*args))
    train_in_process(workdir)
  return workdir


COMPILED_ON = []  # full_run's (function, thread, training steps done) of each program compiled
STEPS_BEFORE_COMPILE_AHEAD = []  # training steps done before compile_ahead, at each call
LOWERED_AFTER = []  # training steps done at each lowering ahead
TRAIN_STEP_TRACES = []  # the thread of each trace of the training step
TRACES_BEFORE_COMPILE_AHEAD = []  # traces of the training step before compile_ahead, at each call


@pytest.mark.slow
def test_evaluation_programs_compile_on_a_thread_while_training_runs(full_run):
  """The validation loss step and both splits' beam searches: each compiled once, ahead, after
  the first training step (lowered from the start, while that step compiles alone)."""
  assert STEPS_BEFORE_COMPILE_AHEAD == [0] and LOWERED_AFTER[0] == 0
  functions = {function for function, _, _ in COMPILED_ON}
  assert functions == {'eval_step', 'search'}  # the loss step, the beam search
  assert all(thread == 'compile_ahead' and steps >= 1 for _, thread, steps in COMPILED_ON), (
      COMPILED_ON)
  beam_searches = [f for f, _, _ in COMPILED_ON if f == 'search']
  assert 1 <= len(beam_searches) <= 6  # decode shapes of two splits


def test_the_training_step_is_traced_once_before_compile_ahead_starts(full_run):
  """compile_ahead's thread traces the evaluation programs only once the training step is
  traced: the two would share the interpreter, delaying the first step."""
  assert TRACES_BEFORE_COMPILE_AHEAD == [1] and TRAIN_STEP_TRACES == ['MainThread']


def test_training_writes_config_metrics_and_checkpoints_and_lowers_the_loss(full_run):
  with open(os.path.join(full_run, 'config.json')) as f:
    assert json.load(f) == json.loads(tiny.get_config().to_json())
  rows = read_metrics(full_run)
  train_rows = [r for r in rows if 'split' not in r]
  eval_rows = [r for r in rows if r.get('split') == 'validation' and 'loss' in r]
  assert [r['step'] for r in train_rows] == [20, 40, 60, 80, 100]
  assert [r['step'] for r in eval_rows] == [50, 100]
  # Every row has its wall-clock time, in the order written, within the last hour.
  times = [r['time'] for r in rows]
  assert times == sorted(times) and time.time() - 3600 < times[0] < times[-1] < time.time()
  # The end: both BLEUs on validation and test with the last average_last=2 checkpoints.
  assert [(r['split'], r['checkpoint_steps']) for r in rows if 'sacrebleu' in r] == [
      ('validation', [50, 100]), ('test', [50, 100])]
  for key in ('loss', 'nll', 'perplexity', 'accuracy', 'learning_rate', 'grad_norm',
              'target_tokens_per_sec', 'step_secs', 'model_flops_per_sec', 'eta_secs'):
    assert all(np.isfinite(r[key]) for r in train_rows), key
  config = tiny.get_config()
  for row in train_rows:
    step, peak = row['step'], config.lr_scale * config.model.d_model**-0.5
    assert row['learning_rate'] == pytest.approx(
        peak * min(step**-0.5, step * config.warmup_steps**-1.5), rel=1e-6)
  assert train_rows[-1]['loss'] < train_rows[0]['loss'] - 0.5
  assert eval_rows[-1]['loss'] < eval_rows[0]['loss'] - 0.3
  assert Checkpoints(full_run).all_steps() == [50, 100]
  assert os.listdir(os.path.join(full_run, 'tensorboard'))


def tensorboard_texts(workdir) -> dict[tuple[str, int], str]:
  """{(tag, step): text} of the text summaries in a run's TensorBoard event files."""
  texts = {}
  for name in os.listdir(os.path.join(workdir, 'tensorboard')):
    with open(os.path.join(workdir, 'tensorboard', name), 'rb') as f:
      content = f.read()
    offset = 0
    while offset < len(content):  # TFRecords: length, its CRC, the Event, the Event's CRC
      (length,) = struct.unpack('<Q', content[offset:offset + 8])
      event = event_pb2.Event.FromString(content[offset + 12:offset + 12 + length])
      offset += 16 + length
      for value in event.summary.value:
        if value.tensor.string_val:
          texts[value.tag.split('/text_summary')[0], event.step] = (
              value.tensor.string_val[0].decode())
  return texts


def test_step_times_leave_out_evaluation_and_checkpoints_anywhere_in_a_log_window(tmp_path,
                                                                                  monkeypatch):
  clock = [1000.0]
  monkeypatch.setattr(metrics, 'time', types.SimpleNamespace(time=lambda: clock[0]))
  writer = metrics.MetricsWriter(str(tmp_path), enabled=True)
  log = metrics.TrainLog(types.SimpleNamespace(num_train_steps=8), (1, 1), None, writer)
  step_sums = {key: np.ones(1) for key in ('loss', 'nll', 'correct', 'tokens', 'source_tokens',
                                           'finite', 'learning_rate', 'grad_norm')}
  pauses = {2: 10.0, 4: 30.0}  # a checkpoint inside the first window, an evaluation at its log
  for step in range(1, 9):
    clock[0] += 1.0  # each step takes a second
    log.add(step_sums)
    if step % 4 == 0:
      log.write(step)
    if step in pauses:
      with log.paused():
        clock[0] += pauses[step]
  writer.close()
  assert [(r['step'], r['step_secs']) for r in read_metrics(str(tmp_path))] == [(4, 1.0),
                                                                                (8, 1.0)]


def test_tensorboard_shows_the_config_and_sample_translations(full_run):
  texts = tensorboard_texts(full_run)
  config = json.loads('\n'.join(line[4:] for line in texts['config', 0].splitlines()))
  assert config == json.loads(tiny.get_config().to_json())
  hypotheses = {}
  for split in ('validation', 'test'):
    table = texts[f'{split}/translations', 100].splitlines()
    assert table[0] == '| source | reference | translation |' and len(table) == 2 + 8
    hypotheses[split] = [row.split(' | ')[2] for row in table[2:]]
  sources, references = data.split_texts(tiny.get_config(), 'test')
  assert [row.split(' | ')[:2] for row in texts['test/translations', 100].splitlines()[2:]] == [
      [f'| {s}', r] for s, r in zip(sources[:8], references[:8])]
  assert all(all(split_hypotheses) for split_hypotheses in hypotheses.values())


@pytest.mark.slow
def test_the_compilation_cache_key_keeps_compiled_programs(tmp_path):
  cache = tmp_path / 'cache'
  result = subprocess.run(
      train_command(tmp_path / 'run', '--config.num_train_steps=2', '--config.eval_every_steps=0',
                    f'--config.compilation_cache_dir={cache}'),
      cwd=ROOT, env=_env(1, compilation_cache=False), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(os.listdir(cache)) >= 3  # at least initialisation, the train step and a beam search


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted_run(full_run, tmp_path):
  workdir = str(tmp_path)
  assert re.search(r'training step compiled and dispatched in \d+\.\d s',
                   train_in_process(workdir, num_train_steps=50, **NO_EVALUATION))
  assert 'resumed from step 50' in train_in_process(workdir, **NO_EVALUATION)
  resumed, meta = restore(workdir, 100)
  uninterrupted, meta_full = restore(full_run, 100)
  assert meta == meta_full
  assert max_difference(resumed, uninterrupted) == 0.0
  rows = read_metrics(workdir)
  # The first run logged its last step, 50, too.
  assert [r['step'] for r in rows if 'split' not in r] == [20, 40, 50, 60, 80, 100]


@pytest.mark.slow
def test_a_run_preempted_off_its_schedule_averages_what_an_uninterrupted_one_does(full_run,
                                                                                   tmp_path,
                                                                                   monkeypatch):
  # A SIGTERM at step 75, between the scheduled checkpoints of 50 and 100 (tiny keeps and
  # averages 2): the run saves 75 to resume from, and that checkpoint leaves no scheduled one out.
  workdir = str(tmp_path)
  config = tiny.get_config()

  class PreemptedAt75(trainer._OptimizerStep):
    calls = 0

    def __call__(self, *args):
      PreemptedAt75.calls += 1
      if PreemptedAt75.calls == 75:
        os.kill(os.getpid(), signal.SIGTERM)
      return super().__call__(*args)

  with monkeypatch.context() as patch:
    patch.setattr(trainer, '_OptimizerStep', PreemptedAt75)
    assert 'SIGTERM: saved a checkpoint at step 75' in train_in_process(workdir, **NO_EVALUATION)
  assert Checkpoints(workdir).all_steps() == [50, 75]
  assert 'resumed from step 75' in train_in_process(workdir, **NO_EVALUATION)
  assert Checkpoints(workdir).all_steps() == [50, 100]  # 75 gave way to the schedule's 100
  (resumed, resumed_steps), (uninterrupted, steps) = (
      load_params(path, config) for path in (workdir, full_run))
  assert resumed_steps == steps == [50, 100]
  assert max_difference(resumed, uninterrupted) == 0.0


@pytest.mark.slow
def test_resuming_on_another_device_count_warns_of_other_batches(full_run, tmp_path):
  workdir = os.path.join(str(tmp_path), 'run')
  shutil.copytree(full_run, workdir)
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '100'))
  # The device count from config.xla_flags, which train.py adds to XLA_FLAGS before JAX starts.
  result = run_train(workdir, '--config.num_train_steps=51', '--config.final_bleu_splits=',
                     '--config.xla_flags=--xla_force_host_platform_device_count=2', devices=None)
  assert ('checkpoint 50 was written on 4 devices, this run has 2: the resumed run sees other '
          'batches') in result.stderr
  assert restore(workdir, 51)[1]['data_shards'] == 2


def test_closing_the_evaluator_stops_compiling_ahead_after_the_program_at_hand(tmp_path,
                                                                               monkeypatch):
  config = tiny.get_config()
  config.implementation.decode_batch_tokens = 3 * 16  # beam 4, 12 source tokens a call: several search shapes
  vocab = data.load_or_train_vocabulary(config, str(tmp_path))
  shard = dict(process_index=0, process_count=1, num_devices=jax.local_device_count())
  steps = train_step.StepFunctions(config, choice.for_this_machine(config))
  evaluation = evaluator.Evaluator(config, vocab, steps, shard,
                                  metrics.MetricsWriter(str(tmp_path), enabled=False))
  params = jax_utils.replicate(packing.pack_state(train_step.initial_state(config)).params)
  compile_program, compiling = compile_ahead.Programs._compile, threading.Event()
  compiled_keys = []

  def compile_once_closing(programs, key, args):  # the first compilation outlasts `close`'s call
    compiling.set()
    while not evaluation.ahead._closing.is_set():
      time.sleep(0.01)
    compiled_keys.append(key)
    return compile_program(programs, key, args)

  monkeypatch.setattr(compile_ahead.Programs, '_compile', compile_once_closing)
  evaluation.compile_ahead(params, ['validation'], ['validation', 'test'])
  evaluation.training_started()
  assert compiling.wait(60)
  evaluation.close()
  assert len(compiled_keys) == 1 and list(evaluation.eval_programs.compiled) == compiled_keys
  # The beam searches were lowered before it and stay uncompiled.
  searches = evaluation.translator.programs
  assert len(searches._lowered) >= 2 and not searches.compiled


_TWO_CTRL_C = """
import os, signal, sys, time
from transformer import interrupts, preemption as preemption_lib
if sys.argv[1] == 'ignored':  # as for a script's background job
  signal.signal(signal.SIGINT, signal.SIG_IGN)
interrupts.end_at_once('train.py')
preemption = preemption_lib.Preemption()
os.kill(os.getpid(), signal.SIGINT)
time.sleep(1)
print(preemption.received, preemption.signal_name, flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
"""


@pytest.mark.slow
@pytest.mark.parametrize('case', ['terminal', 'ignored'])
def test_a_second_ctrl_c_ends_at_once_and_an_ignored_one_stays_ignored(case):
  process = popen_as_from_a_terminal([sys.executable, '-c', _TWO_CTRL_C, case], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  result = subprocess.CompletedProcess([], None, *process.communicate(timeout=600))
  result.returncode = process.returncode
  if case == 'ignored':
    assert result.returncode == 0 and result.stdout == 'False a signal to another host\n'
    return
  assert result.returncode == 130 and result.stdout == 'True SIGINT\n', result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      'train.py: stopped by Ctrl-C; the files it was writing are as they were')
  assert 'Ctrl-C: a checkpoint of this step, then the end; Ctrl-C again ends at once' in (
      result.stderr)


# train.py with one call of a phase made a library's long call (minutes in C, where Python runs
# no signal handler) inside a file's atomic write: argv[1] the workdir, argv[2] the phase.
_LONG_CALL = """
import hashlib, os, runpy, sys
from absl import logging
from transformer import evaluator, files, trainer
from transformer.data import vocabulary

workdir, phase = sys.argv[1:3]

def long_call(*args, **kwargs):
  with files.open_atomically(os.path.join(workdir, 'half_written')) as f:
    f.write(b'half')
    logging.info('a long call begins')
    hashlib.pbkdf2_hmac('sha256', b'', b'', 2**31 - 1)

if phase == 'preparing':  # the vocabulary's training
  vocabulary.load_or_train_model = long_call
elif phase == 'compiling':  # the first step, which compiles it
  trainer._OptimizerStep.__call__ = long_call
else:  # the closing BLEU
  evaluator.Evaluator.bleu = long_call
sys.argv = ['train.py', '--config=configs/tiny.py', f'--workdir={workdir}', *sys.argv[3:]]
runpy.run_path('train.py', run_name='__main__')
"""


@pytest.mark.slow
@pytest.mark.parametrize('phase, said', [
    ('preparing', 'stopped before training: nothing new to save, and the files prepared so far '
     'are whole'),
    ('compiling', 'stopped while compiling the train step: nothing new to save since the start'),
    ('evaluating', 'stopped in the closing BLEU: every checkpoint is saved, the last at step 2;'),
])
def test_a_signal_while_there_is_nothing_to_save_ends_the_run_at_once(tmp_path, phase, said):
  workdir = str(tmp_path / 'run')
  process = subprocess.Popen(
      [sys.executable, '-c', _LONG_CALL, workdir, phase, '--config.num_train_steps=2'], cwd=ROOT,
      env=_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  seen = []
  for line in process.stderr:
    seen.append(line)
    if 'a long call begins' in line:
      break
  writing = [name for name in os.listdir(workdir) if name.startswith('half_written.tmp-')]
  process.send_signal(signal.SIGTERM)
  try:  # the long call takes hours: a process that ended within the hang guard ended at once
    stderr = ''.join(seen) + process.communicate(timeout=120)[1]
  finally:
    process.kill()  # one that did not end
  assert process.returncode == 0, stderr[-3000:]
  assert f'SIGTERM: {said}' in stderr
  # The write under way left nothing: neither the file nor its temporary.
  assert writing, stderr[-3000:]
  assert not [name for name in os.listdir(workdir) if name.startswith('half_written')]
  if phase == 'evaluating':
    assert Checkpoints(workdir).all_steps() == [2]


@pytest.mark.slow
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_bleu_saves_first_and_the_run_resumes_exactly(full_run, tmp_path, signum):
  # A BLEU evaluation at step 30, one sentence per beam-search call: long enough to be cut.
  workdir = str(tmp_path)
  process = popen_as_from_a_terminal(
      train_command(workdir, '--config.bleu_every_steps=30', '--config.implementation.decode_batch_tokens=1'),
      cwd=ROOT, env=_env(4), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  seen = []
  for line in process.stderr:  # until the evaluation starts
    seen.append(line)
    if 'translating validation' in line:
      break
  process.send_signal(signum)  # SIGINT: Ctrl-C
  signalled = time.time()
  stderr = ''.join(seen) + process.communicate(timeout=300)[1]
  assert process.returncode == 0, stderr[-3000:]
  assert time.time() - signalled < 60  # a hang guard; that the evaluation was cut is said below
  assert 'validation BLEU at step 30: translation stopped after' in stderr
  assert f'{signum.name}: saved a checkpoint at step 30; stopping' in stderr
  assert ('Ctrl-C: a checkpoint of this step, then the end; Ctrl-C again ends at once' in
          stderr) == (signum == signal.SIGINT)
  assert Checkpoints(workdir).all_steps() == [30]
  assert not [r for r in read_metrics(workdir) if 'sacrebleu' in r]

  assert 'resumed from step 30' in train_in_process(workdir, **NO_EVALUATION)
  assert max_difference(restore(workdir, 100)[0], restore(full_run, 100)[0]) == 0.0


@pytest.mark.slow
def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(full_run, tmp_path):
  workdir = os.path.join(str(tmp_path), 'run')
  shutil.copytree(full_run, workdir)
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '100'))
  good, _ = restore(workdir, 50)
  result = run_train(workdir, '--config.lr_scale=1e30', *NO_EVALUATION_FLAGS, expect_ok=False)
  assert result.returncode != 0 and 'Traceback' not in result.stderr
  message = result.stderr.strip().splitlines()[-1]
  assert message.startswith('train.py: the loss is nan at step 5')
  assert 'latest checkpoint (step 50)' in message
  assert Checkpoints(workdir).all_steps() == [50]
  assert max_difference(restore(workdir, 50)[0], good) == 0.0


@pytest.mark.slow
def test_a_non_finite_loss_before_any_checkpoint_says_so(tmp_path):
  result = run_train(str(tmp_path), '--config.lr_scale=1e30', '--config.num_train_steps=5',
                     *NO_EVALUATION_FLAGS, expect_ok=False)
  message = result.stderr.strip().splitlines()[-1]
  assert message.startswith('train.py: the loss is nan at step ')
  assert 'training stopped; no checkpoint was written before it. Lower the learning rate' in (
      message)


@pytest.mark.parametrize('override,message', [
    ({'implementation.attention': 'cudnn', 'model.dtype': 'bfloat16'},
     "config.implementation.attention='cudnn': cuDNN attention needs an NVIDIA GPU of "
     "compute capability 8.0 or later (here: cpu)")])
def test_a_config_this_backend_cannot_run_leaves_the_workdir_as_it_was(tmp_path, override,
                                                                       message):
  workdir = tmp_path / 'run'
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    train_in_process(str(workdir), **override)
  assert not workdir.exists()


def test_a_run_resumed_at_or_past_its_last_step_trains_nothing_and_changes_nothing(full_run,
                                                                                   tmp_path):
  """Its config.json keeps the steps eval.py averages; no file of the workdir changes."""
  workdir = tmp_path / 'run'
  shutil.copytree(full_run, workdir)
  files_of = lambda: {str(path.relative_to(workdir)): path.read_bytes()
                      for path in sorted(workdir.rglob('*')) if path.is_file()}
  before = files_of()
  logged = train_in_process(str(workdir), num_train_steps=50, checkpoint_every_steps=25)
  assert (f'checkpoint 100 is at or past config.num_train_steps=50: nothing to train, and nothing '
          f'in {workdir} changed (raise num_train_steps to train on; eval.py scores the run)'
          ) in logged
  assert files_of() == before
  assert Checkpoints(str(workdir), 3).all_steps() == [50, 100]


@pytest.mark.slow
@pytest.mark.parametrize('splits', ['test', ''])
def test_the_closing_bleu_scores_the_final_bleu_splits_only(tmp_path, splits):
  """A quick check of a set-up (a few steps) can leave out the closing BLEU, which an untrained
  model makes long; its progress is logged."""
  workdir = str(tmp_path / 'run')
  logged = train_in_process(workdir, num_train_steps=4, checkpoint_every_steps=0, average_last=1,
                            eval_every_steps=0, final_bleu_splits=splits)
  assert [r['split'] for r in read_metrics(workdir) if 'sacrebleu' in r] == (
      [splits] if splits else [])
  assert ('translated 200/200 sentences' in logged) == bool(splits)


def test_resuming_with_another_model_is_refused(full_run):
  with pytest.raises(config_lib.ConfigError, match='config.model.d_ff=128 conflicts with 64 in'):
    train_in_process(full_run, **{'model.d_ff': 128})


def test_a_workdir_that_cannot_be_a_directory_is_named(tmp_path):
  file = tmp_path / 'file'
  file.write_text('', encoding='utf-8')
  with pytest.raises(DirectoryError, match=re.escape(
      f'--workdir: {file} cannot be made a directory (a file of that name exists)')):
    train_in_process(str(file))
  assert os.listdir(tmp_path) == ['file']


@pytest.mark.parametrize('in_the_way, message', [
    ('run.lock/', "--workdir: WORKDIR/run.lock cannot be made the run's lock (Is a directory); "
     'move it away'),
    ('metrics.jsonl/', '--workdir: WORKDIR/metrics.jsonl is a directory; give another path, or '
     'move it away'),
    ('checkpoints', '--workdir: WORKDIR/checkpoints is a file where train.py keeps a directory; '
     'move it away'),
    ('tensorboard', '--workdir: WORKDIR/tensorboard is a file where train.py keeps a directory; '
     'move it away'),
])
def test_a_workdir_with_a_file_where_a_directory_goes_or_back_is_named_first(tmp_path,
                                                                            in_the_way, message):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  if in_the_way.endswith('/'):
    (workdir / in_the_way).mkdir()
  else:
    (workdir / in_the_way).write_text('')
  with pytest.raises(DirectoryError, match=re.escape(message.replace('WORKDIR', str(workdir)))):
    train_in_process(str(workdir))
  assert os.listdir(workdir) == [in_the_way.rstrip('/')]  # nothing written
  with pytest.raises(DirectoryError, match='^--workdir is empty; give a directory path$'):
    train_in_process('')  # not the working directory


def test_a_workdir_that_takes_no_file_is_named_before_anything_is_written():
  with pytest.raises(DirectoryError, match=re.escape(
      '--workdir: /sys takes no new file (Permission denied); give a directory you can write to')):
    train_in_process('/sys')  # read-only for root too


@pytest.mark.slow
def test_a_start_that_failed_on_its_data_binds_nothing(tmp_path):
  workdir = str(tmp_path / 'run')
  with pytest.raises(data.DataError, match="config.dataset='no_such/de-en': no such TFDS"):
    train_in_process(workdir, dataset='no_such/de-en', tfds_data_dir=str(tmp_path / 'tfds'))
  assert sorted(os.listdir(workdir)) == ['config.json', lock.LOCK_FILE]
  train_in_process(workdir, num_train_steps=2, checkpoint_every_steps=0,  # the corrected command
                   final_bleu_splits='')
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    assert json.load(f)['dataset'] == 'synthetic'
  # Its vocabulary binds the workdir to it, checkpoints or not.
  shutil.rmtree(os.path.join(workdir, 'checkpoints'))
  with pytest.raises(config_lib.ConfigError, match="config.dataset='no_such/de-en' conflicts "
                                                   "with 'synthetic' in"):
    train_in_process(workdir, dataset='no_such/de-en')


@pytest.mark.slow
@pytest.mark.parametrize('damage', ['truncate', 'delete'])
def test_a_damaged_latest_checkpoint_names_its_directory_and_the_fix(full_run, tmp_path, damage):
  workdir = os.path.join(str(tmp_path), 'run')
  shutil.copytree(full_run, workdir)
  step_dir = os.path.join(workdir, 'checkpoints', '100')
  largest = max((os.path.join(d, f) for d, _, files in os.walk(os.path.join(step_dir, 'state'))
                 for f in files), key=os.path.getsize)
  if damage == 'truncate':
    os.truncate(largest, os.path.getsize(largest) // 2)
  else:
    os.remove(largest)
  with pytest.raises(CheckpointError) as error:
    train_in_process(workdir, num_train_steps=150)
  message = str(error.value)
  assert message.startswith(f'{step_dir} cannot be read, a file in it is damaged or missing (')
  assert message.endswith('delete that directory to use checkpoint 50 instead')
  shutil.rmtree(step_dir)  # as the message says
  assert 'resumed from step 50' in train_in_process(workdir, num_train_steps=60,
                                                    final_bleu_splits='')


@pytest.mark.slow
def test_accumulating_gradients_traces_each_program_once(tmp_path, monkeypatch):
  """The micro-batches' programs are lowered before the first update and not traced again: the
  gradients' function twice, by its own program and inside the accumulating one."""
  traces = []
  for name in ('gradients', 'accumulate', 'apply_gradients'):
    function = getattr(train_step.StepFunctions, name)
    monkeypatch.setattr(train_step.StepFunctions, name, lambda *args, name=name, function=function:
                        traces.append(name) or function(*args))
  log = train_in_process(str(tmp_path), num_train_steps=4, grad_accum_steps=3, log_every_steps=2,
                         final_bleu_splits='')
  assert sorted(traces) == ['accumulate', 'apply_gradients', 'gradients', 'gradients']
  assert re.search(r'step 4/4 \| loss \d', log)


def test_checkpoints_save_on_a_thread_and_a_failed_save_raises_at_the_next_wait(tmp_path,
                                                                               monkeypatch):
  """`save` returns while Orbax still blocks (0.1-0.3 s a checkpoint), what follows sees the
  checkpoint, and a save's error is raised, not lost."""
  checkpoints = Checkpoints(str(tmp_path), keep=2)
  state = {'w': np.arange(6, dtype=np.float32)}
  orbax_save, release, released = checkpoints.manager.save, threading.Event(), []
  monkeypatch.setattr(checkpoints.manager, 'save', lambda *args, **kwargs: (
      released.append(release.wait(5)), orbax_save(*args, **kwargs))[1])
  checkpoints.save(1, state, {'step': 1})
  release.set()  # only now may Orbax's save go on: a save in this thread would have timed out
  assert checkpoints.all_steps() == [1] and released == [True]
  tree, meta = checkpoints.restore(1, {'w': jax.ShapeDtypeStruct((6,), np.float32)})
  np.testing.assert_array_equal(tree['w'], state['w'])
  assert meta == {'step': 1}
  monkeypatch.setattr(checkpoints.manager, 'save', lambda *args, **kwargs: 1 / 0)
  checkpoints.save(2, state, {'step': 2})
  with pytest.raises(ZeroDivisionError):
    checkpoints.wait()
  checkpoints.close()


def test_after_a_failed_save_its_write_tasks_collected_later_log_nothing(tmp_path, monkeypatch,
                                                                         caplog):
  """The one-line error is the last word: a failed write task of Orbax's that is collected after
  it does not make asyncio log the error again, with a traceback."""
  asyncio_logger = logging.getLogger('asyncio')
  monkeypatch.setattr(asyncio_logger, 'level', asyncio_logger.level)  # restored afterwards
  checkpoints = Checkpoints(str(tmp_path), keep=2)
  all_steps = checkpoints.manager.all_steps
  checkpoints.manager.all_steps = lambda: []  # as after a write that failed
  checkpoints.save(1, {'w': np.arange(6, dtype=np.float32)}, {'step': 1})
  with pytest.raises(CheckpointError, match=r'checkpoint 1 could not be written to .* \(not '
                     r'written; a checkpoint takes'):
    checkpoints.wait()
  checkpoints.manager.all_steps = all_steps
  checkpoints.close()

  async def write():
    raise ValueError('OUT_OF_RANGE: Error writing "int32/0"')

  loop = asyncio.new_event_loop()
  task = loop.create_task(write())
  loop.run_until_complete(asyncio.sleep(0.01))
  loop.close()
  del task
  gc.collect()
  assert not [record for record in caplog.records if record.name == 'asyncio']


@pytest.mark.slow
def test_a_save_that_fails_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
  workdir = str(tmp_path / 'run')
  schedule = ('--config.checkpoint_every_steps=20', *NO_EVALUATION_FLAGS)
  run_train(workdir, '--config.num_train_steps=20', *schedule, devices=1)
  # No file over 100 kB: the next checkpoint's (~600 kB) fails to be written, as on a full disk.
  result = run_train(workdir, '--config.num_train_steps=60', *schedule, devices=1,
                     expect_ok=False, max_file_bytes=100_000)
  directory = os.path.join(workdir, 'checkpoints')
  assert re.fullmatch(
      rf'train.py: checkpoint 40 could not be written to {re.escape(directory)} \(File too large; '
      r'a checkpoint takes 0\.\d\d MiB, [\d.]+ MiB are free there\): training stopped; the '
      r'latest checkpoint, step 20, is whole. Free space \(or lower keep_checkpoints\) and run '
      r'the same command again to resume', error_line(result)), result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert os.listdir(directory) == ['20']  # nothing of the failed save is left
  run_train(workdir, '--config.num_train_steps=60', *schedule, devices=1)  # space again: resumed
  assert sorted(os.listdir(directory), key=int) == ['40', '60']  # keep_checkpoints=2


@pytest.mark.slow
def test_a_tensorboard_write_that_fails_stops_the_run_in_one_line(tmp_path):
  workdir = str(tmp_path / 'run')
  schedule = ('--config.checkpoint_every_steps=0', '--config.log_every_steps=5',
              *NO_EVALUATION_FLAGS)
  run_train(workdir, '--config.num_train_steps=20', *schedule, devices=1)
  (events,) = os.listdir(os.path.join(workdir, 'tensorboard'))
  # A resumed run writes a new events file: as big as the first once it has logged as many rows,
  # and it fails soon after, while metrics.jsonl has kilobytes to go. As on a full disk.
  limit = os.path.getsize(os.path.join(workdir, 'tensorboard', events)) + 100
  assert os.path.getsize(os.path.join(workdir, 'metrics.jsonl')) < limit / 2
  result = run_train(workdir, '--config.num_train_steps=60', *schedule, devices=1,
                     expect_ok=False, max_file_bytes=limit)
  assert error_line(result) == (f'train.py: {workdir}/tensorboard could not be written (File too '
                                'large)'), result.stderr[-3000:]
  assert 'Exception' not in result.stderr, result.stderr[-3000:]  # nor in a thread
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == ['20']
  run_train(workdir, '--config.num_train_steps=60', *schedule, devices=1)  # space again: resumed
  assert max(row['step'] for row in read_metrics(workdir)) == 60


def _mixed_state():
  """A state tree with arrays of two dtypes and a scalar, as Adam's count."""
  return {'params': {'b': np.arange(3, dtype=np.float32), 'w': np.full((2, 4), 0.5, np.float32)},
          'opt_state': (np.int32(7), {'mu': np.linspace(-1, 1, 5, dtype=np.float32)})}


def test_a_checkpoint_is_the_plain_tree_orbax_reads_and_restores_as_it_was(tmp_path):
  state = _mixed_state()
  checkpoints = Checkpoints(str(tmp_path))
  checkpoints.save(3, state, {'step': 3})
  checkpoints.wait()
  like = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
  # Orbax alone, without this code, reads it back as the same tree.
  read = ocp.StandardCheckpointer().restore(
      os.path.join(str(tmp_path), 'checkpoints', '3', 'state'), like)
  tree, meta = checkpoints.restore(3, like)
  checkpoints.close()
  for got in (read, tree):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(state)
    for restored, saved in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(state)):
      assert restored.dtype == saved.dtype
      np.testing.assert_array_equal(restored, saved)
  assert meta == {'step': 3}


@pytest.mark.parametrize('written', ['packed', 'without a layout'])
def test_checkpoints_of_earlier_versions_are_still_restored(tmp_path, written):
  """An earlier version's packed state (one vector per dtype, its layout beside it), and the
  first one's (Orbax's tree, no layout)."""
  state = _mixed_state()
  checkpoints = Checkpoints(str(tmp_path))
  items = {'state': ocp.args.StandardSave(state), 'meta': ocp.args.JsonSave({'step': 5})}
  if written == 'packed':
    items.update(state=ocp.args.StandardSave(packing.pack(state)),
                 layout=ocp.args.JsonSave({'arrays': checkpoint_layout(state)}))
  checkpoints.manager.save(5, args=ocp.args.Composite(**items))
  checkpoints.manager.wait_until_finished()
  tree, meta = checkpoints.restore(5, state)
  checkpoints.close()
  assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(state)
  for restored, saved in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(state)):
    assert restored.dtype == saved.dtype
    np.testing.assert_array_equal(restored, saved)
  assert meta == {'step': 5}


def test_a_checkpoint_of_other_arrays_is_refused_naming_the_first_difference(tmp_path):
  state = _mixed_state()
  checkpoints = Checkpoints(str(tmp_path))
  checkpoints.save(3, state, {'step': 3})
  other = dict(state, params=dict(state['params'], w=np.zeros((4, 2), np.float32)))
  with pytest.raises(CheckpointError) as error:
    checkpoints.restore(3, other)
  checkpoints.close()
  assert str(error.value) == (
      f"{os.path.join(str(tmp_path), 'checkpoints', '3')} holds other arrays than this config's "
      "state (4 against 4; the first difference: ['params']['w'] [2, 4] float32 where "
      "['params']['w'] [4, 2] float32 is expected): it was written by another model, or by other "
      'versions of flax or optax; restore it with the config and versions that wrote it')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_hosts_with_two_devices_each_equal_one_host_with_four(tmp_path):
  # Length buckets: packed rows give the same batches too (test_data.py, losses equal), but the
  # updates differ by more rounding, which Adam (eps 1e-9) lifted to 8.6e-4 in some weights.
  settings = dict(num_train_steps=10, checkpoint_every_steps=10, eval_every_steps=10,
                  packing=False, final_bleu_splits='test')
  overrides = [f'--config.{key}={value}' for key, value in settings.items()]
  single = str(tmp_path / 'single')
  train_in_process(single, **settings)

  multi = str(tmp_path / 'multi')
  port = _free_port()
  processes = [
      subprocess.Popen(train_command(multi, *overrides, f'--coordinator_address=127.0.0.1:{port}',
                                     '--num_processes=2', f'--process_id={i}'),
                       cwd=ROOT, env=_env(2, compilation_cache=False), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outputs = [p.communicate(timeout=600) for p in processes]
  for p, (_, stderr) in zip(processes, outputs):
    assert p.returncode == 0, stderr[-3000:]
  assert 'process 0/2, 2 local devices, 4 devices in all' in outputs[0][1]

  single_params, single_meta = restore(single, 10)
  multi_params, multi_meta = restore(multi, 10)
  assert single_meta == multi_meta
  # Dropout is on: each device draws the same masks in both layouts. Differences are rounding.
  assert max_difference(single_params, multi_params) < 1e-5
  single_rows, multi_rows = read_metrics(single), read_metrics(multi)
  assert [(r['step'], r.get('split')) for r in multi_rows] == [
      (r['step'], r.get('split')) for r in single_rows]
  for key in ('loss', 'sacrebleu'):  # training and validation rows; the final test BLEU row
    np.testing.assert_allclose([r[key] for r in multi_rows if key in r],
                               [r[key] for r in single_rows if key in r], rtol=1e-5)
