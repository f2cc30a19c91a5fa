"""The training loop: state, data-parallel steps, metrics, evaluation, checkpoints, preemption.

The only module besides checkpoints.py that touches the workdir:
  config.json     the resolved config; a resumed run must keep its model and data keys
  metrics.jsonl   one JSON object per log step and per evaluation (with `split`)
  tensorboard/    the same scalars for TensorBoard
  checkpoints/    Orbax checkpoints (see checkpoints.py)
  run.lock        held while a run trains (lock.py): one run per workdir
"""

import concurrent.futures
import contextlib
import itertools
import json
import os
import signal
import socket
import threading
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from transformer import config as config_lib
from transformer import bleu, data, interrupts, lock, metrics, model, train_step, translate
from transformer.checkpoints import (CHECKPOINTS_DIR, Checkpoints, local_copy, on_schedule,
                                    state_shapes)
from transformer.data import vocabulary
from transformer.kernels import choice, compile_ahead, packing
from transformer.files import (DirectoryError, check_writable, make_directory, stop_writing,
                               write_atomically)

# Keys a resumed run must share with the stored config.json: they fix the parameters' shapes
# and meaning, and the vocabulary.
RESUME_KEYS = ('model', 'vocab_size', 'vocab_model_type', 'dataset', 'source_lang', 'target_lang',
               'pairs', 'source_tags')
# Model keys that choose how the model computes, not its parameters: a resumed run may change
# them, and a config.json from before they existed lacks them.
IMPLEMENTATION_KEYS = ('attention_implementation', 'output_projection_dtype')
# Keys that set the order of the training batches: a resumed run may change them (say, after a
# move to fewer devices) but then no longer sees the batches an uninterrupted run would.
DATA_ORDER_KEYS = ('seed', 'packing', 'tokens_per_batch', 'grad_accum_steps', 'max_length',
                   'manual_dir', 'train_files', 'vocab_sample_size')


SAMPLES = 8  # translations shown in TensorBoard at each BLEU evaluation


class TrainingError(RuntimeError):
  """Training cannot go on; the message says at which step and why."""


def check_and_write_config(config: ml_collections.ConfigDict, workdir: str, write: bool = True):
  """Refuses to resume with different model or data keys, then records the resolved config
  (unless not `write`).

  A config.json alone binds nothing: a start that failed before its vocabulary (a mistyped
  dataset or path) is replaced by the next.
  """
  path = epath.Path(workdir) / 'config.json'
  current = json.loads(config.to_json())
  made = [epath.Path(workdir, name) for name in (vocabulary.MODEL_FILE, vocabulary.MARIAN_FILE,
                                                  CHECKPOINTS_DIR)]
  if path.exists() and any(made_path.exists() for made_path in made):
    stored = config_lib.read_stored(path)
    for key in RESUME_KEYS:
      old, new = stored.get(key), current[key]
      if isinstance(new, dict):
        for sub in sorted(set(new) | set(old or {})):
          if key == 'model' and sub in IMPLEMENTATION_KEYS:
            continue
          if (old or {}).get(sub) != new.get(sub):
            raise config_lib.ConfigError(
                f'config.{key}.{sub}={new.get(sub)!r} conflicts with {(old or {}).get(sub)!r} '
                f'in {path}; resume with the stored value or start a new --workdir')
      elif old != new:
        raise config_lib.ConfigError(
            f'config.{key}={new!r} conflicts with {old!r} in {path}; resume with the stored '
            'value or start a new --workdir')
    for key in DATA_ORDER_KEYS:
      if stored.get(key) != current[key]:
        logging.warning('config.%s=%r differs from %r in %s: the resumed run sees other batches '
                        'than an uninterrupted one would', key, current[key], stored.get(key),
                        path)
  if write and jax.process_index() == 0:
    write_atomically(path, json.dumps(current, indent=2, sort_keys=True) + '\n')


class _Preemption:
  """Remembers a SIGTERM (preemption) or a first Ctrl-C (SIGINT) so the loop can checkpoint at the
  current step and stop cleanly; a second Ctrl-C stops at once.

  While there is nothing to save (`nothing_to_save` holds what is saved: preparing the data,
  compiling the first step, the closing BLEU), the signal ends the process at once, even inside
  a library's long call (a vocabulary's training, a compilation, a beam search), where Python
  runs no handler until it returns: a thread woken by the signal itself (`signal.set_wakeup_fd`)
  logs what is saved and exits with status 0, nothing half-written (`files.stop_writing`).
  """

  def __init__(self):
    self.received = False
    self.signal_name = 'a signal to another host'  # what `received` comes from, once it is true
    self.nothing_to_save = None  # while there is nothing to save, a line saying what is saved
    signums = [signal.SIGTERM]
    # A SIGINT that was ignored stays so, as for a job a script starts in the background.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
      signums.append(signal.SIGINT)
    self._previous = {signum: signal.signal(signum, self._handle) for signum in signums}
    self._wakeup, wakeup = socket.socketpair()
    wakeup.setblocking(False)
    self._previous_wakeup_fd = signal.set_wakeup_fd(wakeup.fileno())
    self._sockets = (self._wakeup, wakeup)
    threading.Thread(target=self._end_at_once, name='preemption', daemon=True).start()

  def _end_at_once(self):
    """Exits as soon as one of the signals arrives while there is nothing to save, or a second
    Ctrl-C arrives; another signal a command ends on (SIGHUP) ends it too."""
    interrupts_seen = 0
    while True:
      try:
        signums = self._wakeup.recv(64)
      except OSError:  # closed by `restore`
        return
      if not signums:
        return
      for signum in signums:
        if signum not in self._previous and signum in interrupts.SIGNALS:
          interrupts.end_now(signum)
      interrupts_seen += signums.count(signal.SIGINT)
      if interrupts_seen >= 2:
        interrupts.end_now(signal.SIGINT)
      received = [signum for signum in signums if signum in self._previous]
      line = self.nothing_to_save
      if received and line is not None:
        stop_writing()
        logging.info('%s: %s; stopping', signal.Signals(received[0]).name, line)
        logging.flush()
        os._exit(0)

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT and not self.received:
      logging.warning('Ctrl-C: a checkpoint of this step, then the end; Ctrl-C again ends at once')
    self.received, self.signal_name = True, signal.Signals(signum).name

  def restore(self):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self.nothing_to_save = None
    signal.set_wakeup_fd(self._previous_wakeup_fd)
    self._wakeup.shutdown(socket.SHUT_RDWR)  # ends the thread's wait
    for end in self._sockets:
      end.close()


def _agree(*flags: bool) -> tuple[bool, ...]:
  """Host-local events (a signal, a timer) made true on every host if true on any."""
  if jax.process_count() == 1:
    return flags
  return tuple(bool(x) for x in multihost_utils.process_allgather(np.array(flags)).any(axis=0))


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

  def __init__(self, steps: train_step.StepFunctions, grad_accum_steps: int):
    self.micro_steps = [np.full(jax.local_device_count(), i, np.int32)
                        for i in range(grad_accum_steps)]
    if grad_accum_steps == 1:
      self.p_train_step = jax.pmap(steps.train_step, train_step.AXIS, donate_argnums=(0,))
    else:
      self.p_gradients = jax.pmap(steps.gradients, train_step.AXIS)
      self.p_accumulate = jax.pmap(steps.accumulate, train_step.AXIS, donate_argnums=(3,))
      self.p_apply = jax.pmap(steps.apply_gradients, train_step.AXIS, donate_argnums=(0,))

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


class _Evaluator:
  """Validation loss and BLEU at given parameters, of each language pair of a multilingual model
  apart; each split is read and tokenized once."""

  def __init__(self, config, vocab, steps: train_step.StepFunctions, shard: dict,
               writer: metrics.MetricsWriter):
    self.config, self.vocab, self.shard, self.writer = config, vocab, shard, writer
    self.steps = steps
    # Keyed by the batch's shapes.
    self.eval_programs = compile_ahead.Programs(jax.pmap(steps.eval_step, train_step.AXIS))
    self.translator = translate.Translator(config, vocab, config.beam_size, config.alpha)
    # (source, target) of each pair of a multilingual model; None: the one pair, untagged.
    self.pairs = config_lib.language_pairs(config) if config.pairs else [None]
    self.batches = {}  # (split, pair) -> its loss batches
    self.texts = {}  # (split, pair) -> (sources, references)
    self.ahead = compile_ahead.Background()

  def compile_ahead(self, packed_params, loss_splits: list[str], bleu_splits: list[str]):
    """Prepares the loss step of `loss_splits`' batches and the beam searches of `bleu_splits`
    on a background thread (a cold start spends seconds on these programs): lowers them while the
    training step compiles, compiles them once `training_started` is called
    (`compile_ahead.Background`). Where one is not ready when needed, `loss` and `bleu` wait for
    it. Not on several hosts: reading a split gathers from every host, which must not happen
    beside the training loop's own gathers, and pmap compiles no programs ahead there."""
    if jax.process_count() > 1:
      return
    packed_params = compile_ahead.shapes_of(packed_params)  # the next step donates their buffers
    # The beam searches take the parameters' tree, as `bleu` gets it.
    params = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((jax.local_device_count(), *x.shape), x.dtype),
        self.steps.param_shapes)

    def programs_and_args():  # in the order the run needs them
      for split, pair in itertools.product(loss_splits, self.pairs):
        for batch in self._loss_batches(split, pair):
          yield self.eval_programs, (self._loss_key(batch), packed_params, batch)
      for split, pair in itertools.product(bleu_splits, self.pairs):
        try:
          sources = self._texts(split, pair)[0]
        except data.DataError:
          continue  # `bleu` reports it when it gets there
        for args in self.translator.search_programs(params, sources):
          yield self.translator.programs, args

    self.ahead.start(programs_and_args(), 'evaluation programs')

  def training_started(self):
    """Lets `compile_ahead`'s thread compile: the training step has compiled."""
    self.ahead.compile()

  def close(self):
    """Stops `compile_ahead`'s thread after the program at hand, and waits for it (a preempted
    run has seconds left)."""
    self.ahead.close()

  def _loss_batches(self, split: str, pair) -> list:
    if (split, pair) not in self.batches:
      self.batches[split, pair] = list(data.eval_batches(
          self.config, self.vocab, split, **self.shard,
          corpus=data.load_split(self.config, split, pair)))
    return self.batches[split, pair]

  def _texts(self, split: str, pair) -> tuple[list[str], list[str]]:
    """(sources, references) of `split` (of `pair`). Raises DataError where it has none."""
    if (split, pair) not in self.texts:
      self.texts[split, pair] = data.split_texts(self.config, split, pair)
    return self.texts[split, pair]

  @staticmethod
  def _loss_key(batch) -> tuple:
    return tuple((name, value.shape) for name, value in sorted(batch.items()))

  def loss(self, params, step: int, split: str):
    """Logs the loss on `split` (on each pair's part) at a packed state's `params`."""
    for pair in self.pairs:
      sums = [self.eval_programs.get(self._loss_key(batch), params, batch)(params, batch)
              for batch in self._loss_batches(split, pair)]
      summary = metrics.summarize([jax.tree_util.tree_map(lambda x: x[0], s)
                                   for s in jax.device_get(sums)])
      values = {k: summary[k] for k in ('loss', 'nll', 'perplexity', 'accuracy')}
      logging.info('%s at step %d: loss %.4f | nll %.4f | ppl %.2f | acc %.1f%%',
                   _name(split, pair), step, values['loss'], values['nll'], values['perplexity'],
                   100 * values['accuracy'])
      self.writer.write(step, values, split=split, pair=pair and '-'.join(pair))

  def bleu(self, params, step: int, split: str, checkpoint_steps: list[int] | None = None,
           stop=None) -> bool:
    """Translates `split` (each pair's part); logs both BLEUs and a few examples (and which
    checkpoints were averaged into `params`, if given). False if `stop` (see
    `Translator.translate`) cut it short."""
    return all(self._pair_bleu(params, step, split, pair, checkpoint_steps, stop)
               for pair in self.pairs)

  def _pair_bleu(self, params, step: int, split: str, pair, checkpoint_steps, stop) -> bool:
    name = _name(split, pair)
    try:
      sources, references = self._texts(split, pair)
    except data.DataError as error:
      logging.warning('no BLEU on %s: %s', name, error)
      return True
    logging.info('translating %s (%d sentences) at step %d', name, len(sources), step)
    try:
      # With its progress and time left: an untrained model's outputs are long.
      hypotheses = self.translator.translate(params, sources, progress=True, stop=stop)
    except translate.Interrupted as error:
      logging.info('%s BLEU at step %d: %s', name, step, error)
      return False
    language = pair[1] if pair else self.config.target_lang
    values = {'sacrebleu': bleu.sacrebleu_score(hypotheses, references, language)[0],
              'bleu_paper': bleu.paper_bleu(hypotheses, references, language,
                                            config_lib.compound_split(self.config, language))}
    logging.info('%s BLEU at step %d%s: sacreBLEU %.2f | paper BLEU %.2f (%d sentences)', name,
                 step, f', checkpoints {checkpoint_steps} averaged' if checkpoint_steps else '',
                 values['sacrebleu'], values['bleu_paper'], len(sources))
    if checkpoint_steps:
      values['checkpoint_steps'] = checkpoint_steps
    samples = list(zip(sources, references, hypotheses))[:SAMPLES]
    for source, reference, hypothesis in samples[:3]:
      logging.info('  source:      %s\n  reference:   %s\n  translation: %s', source, reference,
                   hypothesis)
    self.writer.write(step, values, split=split, pair=pair and '-'.join(pair))
    self.writer.write_text(step, f'{name.replace(" ", "/")}/translations', samples_table(samples))
    return True


def _name(split: str, pair) -> str:
  """`split`, and the language pair of a multilingual model's part of it: 'validation en-de'."""
  return f'{split} {"-".join(pair)}' if pair else split


def samples_table(samples: list[tuple[str, str, str]]) -> str:
  """A markdown table of (source, reference, translation) rows, '|' escaped."""
  cell = lambda text: text.replace('\\', '\\\\').replace('|', '\\|')
  return '\n'.join(['| source | reference | translation |', '| --- | --- | --- |'] +
                   [f'| {cell(s)} | {cell(r)} | {cell(h)} |' for s, r, h in samples])


class _TrainLog:
  """Collects the steps' metrics on device and turns them into rates at each log step.

  Step times leave out evaluation and checkpointing (`paused`), wherever they fall in the window
  of steps between two logs.
  """

  def __init__(self, config, parameters_per_token: tuple[int, int], checkpoints: Checkpoints,
               writer: metrics.MetricsWriter):
    self.total_steps, self.checkpoints, self.writer = config.num_train_steps, checkpoints, writer
    self.encoder_params, self.decoder_params = parameters_per_token
    self.pending = []
    self.restart_clock()

  def restart_clock(self):
    self.since = time.time()
    self.left_out = 0.0  # seconds since `since` spent in `paused`

  @contextlib.contextmanager
  def paused(self):
    """Leaves the time spent inside out of the step times, from when the steps dispatched before
    it have finished."""
    jax.block_until_ready(self.pending)
    began = time.time()
    try:
      yield
    finally:
      self.left_out += time.time() - began

  def add(self, step_metrics):
    self.pending.append(step_metrics)

  def check_finite(self, step: int) -> list[dict]:
    """The pending steps' metrics on the host; stops at the first non-finite loss."""
    step_metrics = [jax.tree_util.tree_map(lambda x: float(x[0]), m)
                    for m in jax.device_get(self.pending)]
    for offset, m in enumerate(step_metrics):
      if not m['finite']:
        bad_step = step - len(step_metrics) + offset + 1
        latest = self.checkpoints.latest_step()
        kept = (f'the latest checkpoint (step {latest}) holds the last good parameters'
                if latest is not None else 'no checkpoint was written before it')
        raise TrainingError(
            f'the loss is {m["loss"]} at step {bad_step}: training stopped; {kept}. Lower the '
            'learning rate (config.lr_scale) or enable config.grad_clip_norm.')
    return step_metrics

  def write(self, step: int):
    step_metrics = self.check_finite(step)  # waits for the steps to finish computing
    elapsed = time.time() - self.since - self.left_out
    values = metrics.summarize(step_metrics)
    values.update(
        learning_rate=step_metrics[-1]['learning_rate'],
        grad_norm=float(np.mean([m['grad_norm'] for m in step_metrics])),
        step_secs=elapsed / len(step_metrics),
        target_tokens_per_sec=values['target_tokens'] / elapsed,
        # Matrix multiplies only (forward + backward = 6 FLOPs per parameter and token).
        model_flops_per_sec=6 * (self.encoder_params * values['source_tokens'] +
                                 self.decoder_params * values['target_tokens']) / elapsed)
    values['eta_secs'] = values['step_secs'] * (self.total_steps - step)
    if self.writer.enabled:
      logging.info('%s', metrics.log_line(step, self.total_steps, values))
    self.writer.write(step, values)
    self.pending = []
    self.restart_clock()


def _every(step: int, interval: int) -> bool:
  return interval > 0 and step % interval == 0


def _every_between(start: int, end: int, interval: int) -> bool:
  """Whether `_every(step, interval)` holds for a step in (start, end]."""
  return interval > 0 and end // interval > start // interval


def final_bleu_splits(config) -> list[str]:
  """The splits training ends by scoring (config.final_bleu_splits)."""
  return [split for split in config.final_bleu_splits.split(',') if split]


def _final_bleu(config, checkpoints: Checkpoints, evaluator: _Evaluator,
                preemption: _Preemption):
  """Both BLEUs on config.final_bleu_splits with the mean of the last config.average_last
  checkpoints, as eval.py scores the finished run by default (section 6.1 of the paper); a
  SIGTERM or Ctrl-C ends them at once, the checkpoints being written."""
  if not final_bleu_splits(config):
    return
  checkpoints.wait()
  preemption.nothing_to_save = (
      f'stopped in the closing BLEU: every checkpoint is saved, the last at step '
      f'{checkpoints.latest_step()}; eval.py --workdir=DIR scores the run')
  params, steps = checkpoints.mean_params(config.average_last, state_shapes(config))
  params = train_step.replicate(params)
  for split in final_bleu_splits(config):
    evaluator.bleu(params, config.num_train_steps, split, checkpoint_steps=steps)


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


def train(config: ml_collections.ConfigDict, workdir: str):
  """Trains to config.num_train_steps, resuming from the latest checkpoint in `workdir`.

  Raises:
    lock.LockedError: another run holds `workdir`; nothing was written.
    DirectoryError: `workdir` or a file of the run cannot be written (before any is, where that
      can be known); the message names it.
  """
  config_lib.validate(config_lib.with_imported_model(config))
  # The implementations are chosen first: a config this machine cannot run leaves the workdir as
  # it was.
  steps = train_step.StepFunctions(config, choice.for_this_machine(config))
  make_directory(workdir, '--workdir')
  _check_workdir(workdir)
  with _sole_run(workdir):
    _train(config, workdir, steps)


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


@contextlib.contextmanager
def _sole_run(workdir: str):
  """Holds the workdir's lock (process 0's) for the block; every process stops where another run
  holds it."""
  with contextlib.ExitStack() as held:
    error = None
    if jax.process_index() == 0:
      try:
        held.enter_context(lock.hold(workdir))
      except lock.LockedError as locked:
        error = locked
    if _agree(error is not None)[0]:
      raise error or lock.LockedError(f'{workdir} is in use by another run (process 0 says '
                                      'which)')
    yield


def _latest_step(workdir: str) -> int | None:
  """The step of the workdir's newest checkpoint, or None."""
  if not epath.Path(workdir, CHECKPOINTS_DIR).is_dir():
    return None
  checkpoints = Checkpoints(workdir, read_only=True)
  try:
    return checkpoints.latest_step()
  finally:
    checkpoints.close()


def _train(config: ml_collections.ConfigDict, workdir: str, steps: train_step.StepFunctions):
  """`train`'s work, once the workdir is this run's."""
  latest = _latest_step(workdir)
  # Nothing to train: the run changes nothing, and its config.json still gives the steps eval.py
  # averages.
  finished = latest is not None and latest >= config.num_train_steps
  check_and_write_config(config, workdir, write=not finished)
  if finished:
    logging.warning('checkpoint %d is at or past config.num_train_steps=%d: nothing to train, and '
                    'nothing in %s changed (raise num_train_steps to train on; eval.py scores the '
                    'run)', latest, config.num_train_steps, workdir)
    return
  preemption = _Preemption()  # before the data's preparation, which a signal may end too
  preemption.nothing_to_save = ('stopped before training: nothing new to save, and the files '
                                'prepared so far are whole')
  try:
    state, start_step, batches, vocab, checkpoints, shard = _prepare(config, workdir)
  except BaseException:
    preemption.restore()
    raise
  parameters_per_token = model.parameters_per_token(steps.param_shapes)
  logging.info('model: %s parameters', f'{sum(parameters_per_token):,}')
  params_of = jax.pmap(steps.params_tree, train_step.AXIS)  # for BLEU on the way

  optimizer_step = _OptimizerStep(steps, config.grad_accum_steps)
  writer = metrics.MetricsWriter(workdir, enabled=jax.process_index() == 0)
  # Indented four spaces: a code block in the Text tab's markdown.
  writer.write_text(start_step, 'config',
                    '    ' + config.to_json(indent=2).replace('\n', '\n    '))
  evaluator = _Evaluator(config, vocab, steps, shard, writer)
  log = _TrainLog(config, parameters_per_token, checkpoints, writer)
  last_save = time.time()
  stop = lambda: _agree(preemption.received)[0]  # for long evaluations
  scheduled = (config.log_every_steps, config.eval_every_steps, config.bleu_every_steps,
               config.checkpoint_every_steps)
  try:
    preemption.nothing_to_save = (
        'stopped while compiling the train step: nothing new to save since '
        f'{f"checkpoint {start_step}" if start_step else "the start"}')
    began = time.time()
    first = next(batches)
    stream = itertools.chain([first], batches)
    if jax.process_count() == 1:  # where compile_ahead runs
      # Traced before compile_ahead's thread starts tracing too: sharing the interpreter with it
      # delayed the first step.
      optimizer_step.lower(state, first)
    evaluates = _every_between(start_step, config.num_train_steps, config.eval_every_steps)
    evaluator.compile_ahead(state.params, ['validation'] if evaluates else [],
                            final_bleu_splits(config))
    for step in range(start_step + 1, config.num_train_steps + 1):
      state, step_metrics = optimizer_step(state, stream)
      if step == start_step + 1:  # its first call compiled the step before dispatching it
        logging.info('training step compiled%s and dispatched in %.1f s',
                     ' or loaded' if config.compilation_cache_dir else '', time.time() - began)
        preemption.nothing_to_save = None  # a step to save from now on
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
        preempted, secs_due = _agree(preemption.received, secs_due)
      if last or _every(step, config.log_every_steps):
        log.write(step)
      # Preempted: save first, evaluate never (Cloud TPU kills ~30 s after the SIGTERM).
      if not preempted and _every(step, config.eval_every_steps):
        with log.paused():
          evaluator.loss(state.params, step, 'validation')
      if not preempted and _every(step, config.bleu_every_steps):
        with log.paused():
          preempted = not evaluator.bleu(params_of(state.params), step, 'validation', stop=stop)
      if last or preempted or secs_due or _every(step, config.checkpoint_every_steps):
        log.check_finite(step)  # nothing non-finite may reach a checkpoint
        with log.paused():
          saved = packing.unpack_state(local_copy(state), steps.param_shapes)
          checkpoints.save(step, {'params': saved.params, 'opt_state': saved.opt_state},
                           {'step': step, 'data_position': batches.position,
                            'data_shards': jax.device_count()})
        last_save = time.time()
      if preempted:
        logging.info('%s: saved a checkpoint at step %d; stopping', preemption.signal_name, step)
        break
    else:
      _final_bleu(config, checkpoints, evaluator, preemption)
  finally:
    preemption.restore()
    checkpoints.wait()  # first: a preempted run has seconds left
    evaluator.close()
    checkpoints.close()
    writer.close()
