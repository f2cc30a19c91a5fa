"""The training loop (`train`): data-parallel steps, with metrics, evaluation (evaluator.py),
checkpoints (checkpoints.py) and preemption (preemption.py) at their steps.

The only module besides checkpoints.py that touches the workdir:
  config.json     the resolved config; a resumed run must keep its model and data keys
  metrics.jsonl   one JSON object per log step and per evaluation (with `split`)
  tensorboard/    the same scalars for TensorBoard
  checkpoints/    Orbax checkpoints (see checkpoints.py)
  run.lock        held while a run trains (lock.py): one run per workdir
"""

import concurrent.futures
import itertools
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath

from transformer import config as config_lib
from transformer import stored_config
from transformer import data, lock, marian, metrics, train_step
from transformer.checkpoints import (CHECKPOINTS_DIR, Checkpoints, latest_step, local_copy,
                                    on_schedule, state_shapes)
from transformer.evaluator import Evaluator, final_bleu, final_bleu_splits
from transformer.files import DirectoryError, check_writable, make_directory
from transformer.kernels import choice, packing
from transformer.preemption import Preemption, agree


def train(config: ml_collections.ConfigDict, workdir: str):
  """Trains to config.num_train_steps, resuming from the latest checkpoint in `workdir`.

  Raises:
    lock.LockedError: another run holds `workdir`; nothing was written.
    DirectoryError: `workdir` or a file of the run cannot be written (before any is, where that
      can be known); the message names it.
    metrics.TrainingError: the loss stopped being finite; the message says at which step.
  """
  config_lib.validate(marian.with_imported_model(config))
  # The implementations are chosen first: a config this machine cannot run leaves the workdir as
  # it was.
  step_fns = train_step.StepFunctions(config, choice.for_this_machine(config))
  make_directory(workdir, '--workdir')
  _check_workdir(workdir)
  with lock.hold(workdir):
    latest = latest_step(workdir)
    # Nothing to train: the run changes nothing, and its config.json still gives the steps
    # eval.py averages.
    finished = latest is not None and latest >= config.num_train_steps
    stored_config.check_and_write(config, workdir, write=not finished)
    if finished:
      logging.warning('checkpoint %d is at or past config.num_train_steps=%d: nothing to train, '
                      'and nothing in %s changed (raise num_train_steps to train on; eval.py '
                      'scores the run)', latest, config.num_train_steps, workdir)
      return
    preemption = Preemption()  # before the data's preparation, which a signal may end too
    preemption.exit_message = ('stopped before training: nothing new to save, and the files '
                               'prepared so far are whole')
    try:
      state, start_step, batches, vocab, checkpoints, shard = _prepare(config, workdir)
    except BaseException:
      preemption.restore()
      raise
    parameters_per_token = metrics.parameters_per_token(step_fns.param_shapes)
    logging.info('model: %s parameters', f'{sum(parameters_per_token):,}')
    params_of = jax.pmap(step_fns.params_tree, train_step.AXIS)  # for BLEU on the way
    optimizer_step = _OptimizerStep(step_fns, config.grad_accum_steps)
    writer = metrics.MetricsWriter(workdir, enabled=jax.process_index() == 0)
    # Indented four spaces: a code block in the Text tab's markdown.
    writer.write_text(start_step, 'config',
                      '    ' + config.to_json(indent=2).replace('\n', '\n    '))
    evaluator = Evaluator(config, vocab, step_fns, shard, writer)
    log = metrics.TrainLog(config, parameters_per_token, checkpoints, writer)
    last_save = time.time()
    stop = lambda: agree(preemption.received)[0]  # for long evaluations
    scheduled = (config.log_every_steps, config.eval_every_steps, config.bleu_every_steps,
                 config.checkpoint_every_steps)
    try:
      since = f'checkpoint {start_step}' if start_step else 'the start'
      preemption.exit_message = ('stopped while compiling the train step: nothing new to save '
                                 f'since {since}')
      began = time.time()
      first = next(batches)
      stream = itertools.chain([first], batches)
      if jax.process_count() == 1:  # where compile_ahead runs
        # Traced before compile_ahead's thread starts tracing too: sharing the interpreter with
        # it delayed the first step.
        optimizer_step.lower(state, first)
      evaluates = _every_between(start_step, config.num_train_steps, config.eval_every_steps)
      evaluator.compile_ahead(state.params, ['validation'] if evaluates else [],
                              final_bleu_splits(config))
      for step in range(start_step + 1, config.num_train_steps + 1):
        state, step_metrics = optimizer_step(state, stream)
        if step == start_step + 1:  # its first call compiled the step before dispatching it
          logging.info('training step compiled%s and dispatched in %.1f s',
                       ' or loaded' if config.compilation_cache_dir else '', time.time() - began)
          preemption.exit_message = None  # a step to save from now on
          evaluator.training_started()
        log.add(step_metrics)
        checkpoints.check()  # a failed save stops the run at the step it is known
        last = step == config.num_train_steps
        preempted = secs_due = False
        # Agreeing waits for this step on every host: several hosts do it only now and then.
        if (jax.process_count() == 1 or last or any(_every(step, n) for n in scheduled) or
            _every(step, config.preemption_check_every_steps)):
          secs_due = (config.checkpoint_every_secs > 0 and
                      time.time() - last_save >= config.checkpoint_every_secs)
          preempted, secs_due = agree(preemption.received, secs_due)
        if last or _every(step, config.log_every_steps):
          log.write(step)
        # Preempted: save first, evaluate never (Cloud TPU kills ~30 s after the SIGTERM).
        if not preempted and _every(step, config.eval_every_steps):
          with log.paused():
            evaluator.loss(state.params, step, 'validation')
        if not preempted and _every(step, config.bleu_every_steps):
          with log.paused():
            preempted = not evaluator.bleu(params_of(state.params), step, 'validation',
                                           stop=stop)
        if last or preempted or secs_due or _every(step, config.checkpoint_every_steps):
          log.check_finite(step)  # nothing non-finite may reach a checkpoint
          with log.paused():
            saved = packing.unpack_state(local_copy(state), step_fns.param_shapes)
            checkpoints.save(step, {'params': saved.params, 'opt_state': saved.opt_state},
                             {'step': step, 'data_position': batches.position,
                              'data_shards': jax.device_count()})
          last_save = time.time()
        if preempted:
          logging.info('%s: saved a checkpoint at step %d; stopping', preemption.signal_name,
                       step)
          break
      else:
        final_bleu(config, checkpoints, evaluator, preemption)
    finally:
      preemption.restore()
      checkpoints.wait()  # first: a preempted run has seconds left
      evaluator.close()
      checkpoints.close()
      writer.close()


def _check_workdir(workdir: str):
  """Fails before the work where the run's files cannot be written: a read-only disk, a
  directory where a file goes, or the other way round."""
  for name in ('config.json', 'metrics.jsonl'):
    check_writable(os.path.join(workdir, name), '--workdir')
  for name in ('tensorboard', CHECKPOINTS_DIR):
    path = epath.Path(workdir, name)
    if path.exists() and not path.is_dir():
      raise DirectoryError(f'--workdir: {path} is a file where train.py keeps a directory; move '
                           'it away')


def _prepare(config: ml_collections.ConfigDict, workdir: str) -> tuple:
  """(the state, initial or restored, replicated; its step; the training batches from its data
  position on; the vocabulary; the workdir's checkpoints; this host's share of the data)."""
  logging.info('process %d/%d, %d local devices, %d devices in all', jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  shard = dict(process_index=jax.process_index(), process_count=jax.process_count(),
               num_devices=jax.local_device_count())
  with concurrent.futures.ThreadPoolExecutor(1, 'initial_state') as pool:
    # The initialisers compile and run while the data is prepared (1-2 s on a cold start).
    initial_state = pool.submit(train_step.initial_state, config)
    # Read once for the vocabulary and the batches. Other hosts load it once process 0 has
    # prepared it and the vocabulary.
    corpus = data.load_split(config, 'train') if jax.process_index() == 0 else None
    vocab = data.load_or_train_vocabulary(config, workdir, corpus=corpus)
    checkpoints = Checkpoints(workdir, config.keep_checkpoints, on_schedule(config))
    restored, start_step, data_position = _restore(checkpoints, config)
    batches = data.train_batches(config, vocab, start_position=data_position, corpus=corpus,
                                 **shard)
    del corpus  # the text it read
    state = initial_state.result()
  if restored is not None:
    state = state.replace(step=start_step, **restored)
  return (train_step.replicate(packing.pack_state(state)), start_step, batches, vocab,
          checkpoints, shard)


def _restore(checkpoints: Checkpoints, config) -> tuple[dict | None, int, int]:
  """(the latest checkpoint's params and opt_state, its step, its data position); (None, 0, 0)
  when there is none."""
  latest = checkpoints.latest_step()
  if latest is None:
    return None, 0, 0
  tree, meta = checkpoints.restore(latest, state_shapes(config))
  logging.info('resumed from step %d (data position %d)', meta['step'], meta['data_position'])
  if meta.get('data_shards') != jax.device_count():
    # The data is sharded by device: another device count gives other batches.
    logging.warning('checkpoint %d was written on %s devices, this run has %d: the resumed run '
                    'sees other batches than an uninterrupted one would', meta['step'],
                    meta.get('data_shards', 'an unrecorded number of'), jax.device_count())
  return tree, meta['step'], meta['data_position']


class _OptimizerStep:
  """(replicated state, batch iterator) -> (state, metrics): one update, pmapped, over
  `grad_accum_steps` micro-batches."""

  def __init__(self, step_fns: train_step.StepFunctions, grad_accum_steps: int):
    self.micro_steps = [np.full(jax.local_device_count(), i, np.int32)
                        for i in range(grad_accum_steps)]
    if grad_accum_steps == 1:
      self.p_train_step = jax.pmap(step_fns.train_step, train_step.AXIS, donate_argnums=(0,))
    else:
      self.p_gradients = jax.pmap(step_fns.gradients, train_step.AXIS)
      self.p_accumulate = jax.pmap(step_fns.accumulate, train_step.AXIS, donate_argnums=(3,))
      self.p_apply = jax.pmap(step_fns.apply_gradients, train_step.AXIS, donate_argnums=(0,))

  def lower(self, state, batch):
    """Traces and lowers the update's programs for `batch`'s shapes (Python work, which holds
    the interpreter); the first update compiles them without tracing them again."""
    if len(self.micro_steps) == 1:
      self.p_train_step.lower(state, batch)
      return
    accumulated = self.p_gradients.lower(state, batch, self.micro_steps[0]).out_info
    self.p_accumulate.lower(state, batch, self.micro_steps[1], accumulated)
    self.p_apply.lower(state, *accumulated)

  def __call__(self, state, batches):
    if len(self.micro_steps) == 1:
      return self.p_train_step(state, next(batches))
    accumulated = self.p_gradients(state, next(batches), self.micro_steps[0])
    for micro_step in self.micro_steps[1:]:
      accumulated = self.p_accumulate(state, next(batches), micro_step, accumulated)
    return self.p_apply(state, *accumulated)


def _every(step: int, interval: int) -> bool:
  return interval > 0 and step % interval == 0


def _every_between(start: int, end: int, interval: int) -> bool:
  """Whether `_every(step, interval)` holds for a step in (start, end]."""
  return interval > 0 and end // interval > start // interval
