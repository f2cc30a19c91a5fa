"""Training metrics: from per-step token sums to rates, written to metrics.jsonl and TensorBoard."""

import contextlib
import json
import math
import os
import time

import jax
import numpy as np
from absl import logging

from transformer.files import append_line, make_directory, unwritable


def summarize(step_sums: list[dict]) -> dict:
  """Token-weighted averages over steps: loss, nll, perplexity, accuracy (and tokens)."""
  total = {key: float(np.sum([s[key] for s in step_sums])) for key in step_sums[0]}
  tokens = max(total['tokens'], 1.0)
  nll = total['nll'] / tokens
  return {
      'loss': total['loss'] / tokens,
      'nll': nll,
      'perplexity': math.exp(min(nll, 700.0)),
      'accuracy': total['correct'] / tokens,
      'target_tokens': total['tokens'],
      'source_tokens': total['source_tokens'],
  }


def parameters_per_token(params) -> tuple[int, int]:
  """Parameters used per source token (encoder) and per target token (decoder + projection)."""
  size = lambda tree: sum(x.size for x in jax.tree_util.tree_leaves(tree))
  embedding = params['source_embedding']['embedding'].size
  decoder = size(params['decoder']) + size(params.get('output_projection', {})) + (
      embedding if 'output_projection' not in params else 0)
  return size(params['encoder']), decoder


def model_flops(parameters: tuple[int, int], source_tokens, target_tokens, backward: bool = True):
  """The matrix multiplies' FLOPs over real tokens, given `parameters_per_token`: 2 per parameter
  and token forward, 6 with the backward pass."""
  return (6 if backward else 2) * (parameters[0] * source_tokens + parameters[1] * target_tokens)


class MetricsWriter:
  """Appends one JSON object per call to `<workdir>/metrics.jsonl` (with `step`, `time`, and
  `split` for evaluations) and mirrors it to TensorBoard.

  Only process 0 writes; the others accept calls and do nothing.
  """

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    if enabled:
      # Imported here: tensorboardX imports PyTorch where it is installed (2 s), which the
      # commands that import this module but write no metrics (eval.py, translate.py) never need.
      from tensorboardX import event_file_writer, summary  # pylint: disable=import-outside-toplevel
      from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
      self.summary, self.event = summary, event_pb2.Event
      self.path = os.path.join(workdir, 'metrics.jsonl')
      self.tensorboard_dir = os.path.join(workdir, 'tensorboard')
      make_directory(self.tensorboard_dir, '--workdir')
      with self._writing_tensorboard():
        self.tensorboard = event_file_writer.EventsWriter(
            os.path.join(self.tensorboard_dir, 'events'))

  @contextlib.contextmanager
  def _writing_tensorboard(self):
    """A TensorBoard write that fails (a full disk) raises DirectoryError, as metrics.jsonl's."""
    try:
      yield
    except OSError as error:
      raise unwritable(self.tensorboard_dir, error) from None

  def _add(self, step: int, summaries: list):
    """Writes `summaries` at `step` to the events file at once: tensorboardX's SummaryWriter
    writes from a thread, which a full disk ends, after which the run would wait forever on the
    thread's queue."""
    with self._writing_tensorboard():
      for summary in summaries:
        self.tensorboard.write_event(self.event(summary=summary, step=step, wall_time=time.time()))
      self.tensorboard.flush()

  def write(self, step: int, values: dict, split: str | None = None, pair: str | None = None):
    """One row: `values` at `step`, of training or of an evaluation `split` (of one language
    `pair` of a multilingual model, such as 'en-de')."""
    if not self.enabled:
      return
    # 'time' (seconds since the epoch) puts the curves against wall-clock time (transformer.plots).
    row = {'step': step, **({'split': split} if split else {}), **({'pair': pair} if pair else {}),
           'time': time.time(), **values}
    append_line(self.path, json.dumps(row))
    prefix = f'{split}/' if split else 'train/'
    prefix += f'{pair}/' if pair else ''
    self._add(step, [self.summary.scalar(prefix + key, value) for key, value in values.items()
                     if isinstance(value, (int, float))])

  def write_text(self, step: int, tag: str, markdown: str):
    """Text for TensorBoard's Text tab (rendered as markdown), under `tag` at `step`."""
    if self.enabled:
      self._add(step, [self.summary.text(tag, markdown)])

  def close(self):
    if self.enabled:
      try:
        self.tensorboard.close()
      except OSError:  # what failed was raised at its write
        pass


def log_line(step: int, total_steps: int, m: dict) -> str:
  """One human-readable progress line."""
  return (f'step {step}/{total_steps} | loss {m["loss"]:.4f} | nll {m["nll"]:.4f} | '
          f'ppl {m["perplexity"]:.2f} | acc {100 * m["accuracy"]:.1f}% | '
          f'lr {m["learning_rate"]:.3g} | grad norm {m["grad_norm"]:.3f} | '
          f'{m["target_tokens_per_sec"]:,.0f} tgt tok/s | {m["step_secs"]:.3f} s/step | '
          f'{m["model_flops_per_sec"] / 1e12:.3g} TFLOP/s | '
          f'eta {hours_minutes_seconds(m["eta_secs"])}')


def hours_minutes_seconds(secs: float) -> str:
  """'1h02m03s'."""
  return f'{int(secs // 3600)}h{int(secs % 3600 // 60):02d}m{int(secs % 60):02d}s'


class TrainingError(RuntimeError):
  """Training cannot go on; the message says at which step and why."""


class TrainLog:
  """Collects the steps' metrics on device and turns them into rates at each log step.

  Step times leave out evaluation and checkpointing (`paused`), wherever they fall in the window
  of steps between two logs.
  """

  def __init__(self, config, parameters_per_token: tuple[int, int], checkpoints,
               writer: MetricsWriter):
    self.total_steps, self.checkpoints, self.writer = config.num_train_steps, checkpoints, writer
    self.parameters = parameters_per_token
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
    values = summarize(step_metrics)
    values.update(
        learning_rate=step_metrics[-1]['learning_rate'],
        grad_norm=float(np.mean([m['grad_norm'] for m in step_metrics])),
        step_secs=elapsed / len(step_metrics),
        target_tokens_per_sec=values['target_tokens'] / elapsed,
        model_flops_per_sec=model_flops(self.parameters, values['source_tokens'],
                                        values['target_tokens']) / elapsed)
    values['eta_secs'] = values['step_secs'] * (self.total_steps - step)
    if self.writer.enabled:
      logging.info('%s', log_line(step, self.total_steps, values))
    self.writer.write(step, values)
    self.pending = []
    self.restart_clock()
