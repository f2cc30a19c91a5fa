"""The training loop: state, data-parallel steps, metrics, evaluation, checkpoints, preemption.

The only module besides checkpoints.py that touches the workdir:
  config.json     the resolved config; a resumed run must keep its model and data keys
  metrics.jsonl   one JSON object per log step and per evaluation (with `split`)
  tensorboard/    the same scalars for TensorBoard
  checkpoints/    Orbax checkpoints (see checkpoints.py)
"""

import json
import os
import signal
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import jax_utils
from jax.experimental import multihost_utils

from transformer import config as config_lib
from transformer import bleu, data, metrics, model, train_step, translate
from transformer.checkpoints import Checkpoints, local_copy
from transformer.files import write_atomically

# Keys a resumed run must share with the stored config.json: they fix the parameters' shapes
# and meaning, and the vocabulary.
RESUME_KEYS = ('model', 'vocab_size', 'vocab_model_type', 'dataset', 'source_lang', 'target_lang')
# Keys that set the order of the training batches: a resumed run may change them (say, after a
# move to fewer devices) but then no longer sees the batches an uninterrupted run would.
DATA_ORDER_KEYS = ('seed', 'packing', 'tokens_per_batch', 'grad_accum_steps', 'max_length',
                   'manual_dir', 'train_files', 'vocab_sample_size')


class TrainingError(RuntimeError):
  """Training cannot go on; the message says at which step and why."""


def check_and_write_config(config: ml_collections.ConfigDict, workdir: str):
  """Refuses to resume with different model or data keys, then records the resolved config."""
  path = os.path.join(workdir, 'config.json')
  current = json.loads(config.to_json())
  if os.path.exists(path):
    with open(path) as f:
      stored = json.load(f)
    for key in RESUME_KEYS:
      old, new = stored.get(key), current[key]
      if isinstance(new, dict):
        for sub in sorted(set(new) | set(old or {})):
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
  if jax.process_index() == 0:
    write_atomically(path, json.dumps(current, indent=2, sort_keys=True) + '\n')


class _Preemption:
  """Remembers a SIGTERM so the loop can checkpoint at the current step and stop cleanly."""

  def __init__(self):
    self.received = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    self.received = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)


def _agree(*flags: bool) -> tuple[bool, ...]:
  """Host-local events (a signal, a timer) made true on every host if true on any."""
  if jax.process_count() == 1:
    return flags
  return tuple(bool(x) for x in multihost_utils.process_allgather(np.array(flags)).any(axis=0))


def train(config: ml_collections.ConfigDict, workdir: str):
  """Trains to config.num_train_steps, resuming from the latest checkpoint in `workdir`."""
  config_lib.validate(config)
  os.makedirs(workdir, exist_ok=True)
  check_and_write_config(config, workdir)
  is_main = jax.process_index() == 0
  local_devices = jax.local_device_count()
  logging.info('process %d/%d, %d local devices, %d devices in all', jax.process_index(),
               jax.process_count(), local_devices, jax.device_count())

  vocab = data.load_or_train_vocabulary(config, workdir)
  model_config = config_lib.model_config(config)
  steps = train_step.StepFunctions(config, model_config)
  state = train_step.initial_state(config, model_config)
  encoder_params, decoder_params = model.parameters_per_token(state.params)
  logging.info('model: %s parameters', f'{encoder_params + decoder_params:,}')

  checkpoints = Checkpoints(workdir, config.keep_checkpoints)
  start_step, data_position = 0, 0
  latest = checkpoints.latest_step()
  if latest is not None:
    tree, meta = checkpoints.restore(latest, {'params': state.params,
                                              'opt_state': state.opt_state})
    state = state.replace(step=meta['step'], **tree)
    start_step, data_position = meta['step'], meta['data_position']
    logging.info('resumed from step %d (data position %d)', start_step, data_position)
    if meta.get('data_shards') != jax.device_count():
      # The data is sharded by device: another device count gives other batches.
      logging.warning('checkpoint %d was written on %s devices, this run has %d: the resumed '
                      'run sees other batches than an uninterrupted one would', start_step,
                      meta.get('data_shards', 'an unrecorded number of'), jax.device_count())
  state = jax_utils.replicate(state)

  p_train_step = jax.pmap(steps.train_step, train_step.AXIS, donate_argnums=(0,))
  p_gradients = jax.pmap(steps.gradients, train_step.AXIS)
  p_accumulate = jax.pmap(steps.accumulate, train_step.AXIS, donate_argnums=(3,))
  p_apply = jax.pmap(steps.apply_gradients, train_step.AXIS, donate_argnums=(0,))
  p_eval = jax.pmap(steps.eval_step, train_step.AXIS)
  micro_steps = [np.full(local_devices, i, np.int32) for i in range(config.grad_accum_steps)]

  shard = dict(process_index=jax.process_index(), process_count=jax.process_count(),
               num_devices=local_devices)
  batches = data.train_batches(config, vocab, start_position=data_position, **shard)
  writer = metrics.MetricsWriter(workdir, enabled=is_main)
  preemption = _Preemption()

  eval_data = {}  # split -> its batches (loss) or texts (BLEU), read and tokenized once

  def evaluate(step: int, split: str):
    if split not in eval_data:
      eval_data[split] = list(data.eval_batches(config, vocab, split, **shard))
    sums = [p_eval(state.params, batch) for batch in eval_data[split]]
    summary = metrics.summarize([jax.tree_util.tree_map(lambda x: x[0], s)
                                 for s in jax.device_get(sums)])
    values = {k: summary[k] for k in ('loss', 'nll', 'perplexity', 'accuracy')}
    logging.info('%s at step %d: loss %.4f | nll %.4f | ppl %.2f | acc %.1f%%', split, step,
                 values['loss'], values['nll'], values['perplexity'], 100 * values['accuracy'])
    writer.write(step, values, split=split)

  translator = translate.Translator(config, vocab, config.beam_size, config.alpha)

  def score_bleu(step: int, split: str):
    """Translates `split` with the current parameters; logs both BLEUs and a few examples."""
    if ('texts', split) not in eval_data:
      try:
        eval_data['texts', split] = data.split_texts(config, split)
      except data.DataError as error:
        logging.warning('no BLEU on %s: %s', split, error)
        return
    sources, references = eval_data['texts', split]
    hypotheses = translator.translate(state.params, sources)
    values = {'sacrebleu': bleu.sacrebleu_score(hypotheses, references, config.target_lang)[0],
              'bleu_paper': bleu.paper_bleu(hypotheses, references, config.target_lang)}
    logging.info('%s BLEU at step %d: sacreBLEU %.2f | paper BLEU %.2f (%d sentences)', split,
                 step, values['sacrebleu'], values['bleu_paper'], len(sources))
    for source, reference, hypothesis in list(zip(sources, references, hypotheses))[:3]:
      logging.info('  source:      %s\n  reference:   %s\n  translation: %s', source, reference,
                   hypothesis)
    writer.write(step, values, split=split)

  def fetch_finite(step: int, pending: list) -> list[dict]:
    """The pending steps' metrics on the host; stops at the first non-finite loss."""
    step_metrics = [jax.tree_util.tree_map(lambda x: float(x[0]), m)
                    for m in jax.device_get(pending)]
    for offset, m in enumerate(step_metrics):
      if not m['finite']:
        bad_step = step - len(step_metrics) + offset + 1
        raise TrainingError(
            f'the loss is {m["loss"]} at step {bad_step}: training stopped; the latest '
            f'checkpoint (step {checkpoints.latest_step()}) holds the last good parameters. '
            'Lower the learning rate (config.lr_scale) or enable config.grad_clip_norm.')
    return step_metrics

  def log_train_metrics(step: int, pending: list, since: float):
    step_metrics = fetch_finite(step, pending)  # waits for the steps to finish computing
    elapsed = time.time() - since
    values = metrics.summarize(step_metrics)
    values.update(
        learning_rate=step_metrics[-1]['learning_rate'],
        grad_norm=float(np.mean([m['grad_norm'] for m in step_metrics])),
        step_secs=elapsed / len(step_metrics),
        target_tokens_per_sec=values['target_tokens'] / elapsed,
        # Matrix multiplies only (forward + backward = 6 FLOPs per parameter and token).
        model_flops_per_sec=6 * (encoder_params * values['source_tokens'] +
                                 decoder_params * values['target_tokens']) / elapsed)
    values['eta_secs'] = values['step_secs'] * (config.num_train_steps - step)
    if is_main:
      logging.info('%s', metrics.log_line(step, config.num_train_steps, values))
    writer.write(step, values)

  def every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0

  pending, interval_start, last_save = [], time.time(), time.time()
  try:
    for step in range(start_step + 1, config.num_train_steps + 1):
      micro_batches = [next(batches) for _ in range(config.grad_accum_steps)]
      if config.grad_accum_steps == 1:
        state, step_metrics = p_train_step(state, micro_batches[0])
      else:
        accumulated = p_gradients(state, micro_batches[0], micro_steps[0])
        for i in range(1, config.grad_accum_steps):
          accumulated = p_accumulate(state, micro_batches[i], micro_steps[i], accumulated)
        state, step_metrics = p_apply(state, *accumulated)
      pending.append(step_metrics)

      secs_due = (config.checkpoint_every_secs > 0 and
                  time.time() - last_save >= config.checkpoint_every_secs)
      preempted, secs_due = _agree(preemption.received, secs_due)
      save_now = (step == config.num_train_steps or preempted or secs_due or
                  every(step, config.checkpoint_every_steps))
      if every(step, config.log_every_steps) or step == config.num_train_steps:
        log_train_metrics(step, pending, interval_start)
        pending, interval_start = [], time.time()
      elif save_now:
        fetch_finite(step, pending)  # nothing non-finite may reach a checkpoint
      if every(step, config.eval_every_steps):
        evaluate(step, 'validation')
        interval_start = time.time()  # step times leave evaluation out
      if every(step, config.bleu_every_steps):
        score_bleu(step, 'validation')
        interval_start = time.time()
      if save_now:
        checkpoints.save(step, local_copy({'params': state.params,
                                           'opt_state': state.opt_state}),
                         {'step': step, 'data_position': batches.position,
                          'data_shards': jax.device_count()})
        last_save = interval_start = time.time()
      if preempted:
        logging.info('SIGTERM: saved a checkpoint at step %d; stopping', step)
        break
    else:
      if start_step < config.num_train_steps:
        score_bleu(config.num_train_steps, 'test')
  finally:
    preemption.restore()
    checkpoints.wait()
    checkpoints.close()
    writer.close()
