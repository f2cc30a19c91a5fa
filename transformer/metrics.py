"""Training metrics: from per-step token sums to rates, written to metrics.jsonl and TensorBoard."""

import contextlib
import json
import math
import os
import time

import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2
from tensorboardX.summary import scalar, text

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


class MetricsWriter:
  """Appends one JSON object per call to `<workdir>/metrics.jsonl` (with `step`, `time`, and
  `split` for evaluations) and mirrors it to TensorBoard.

  Only process 0 writes; the others accept calls and do nothing.
  """

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    if enabled:
      self.path = os.path.join(workdir, 'metrics.jsonl')
      self.tensorboard_dir = os.path.join(workdir, 'tensorboard')
      make_directory(self.tensorboard_dir, '--workdir')
      with self._writing_tensorboard():
        self.tensorboard = EventsWriter(os.path.join(self.tensorboard_dir, 'events'))

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
        self.tensorboard.write_event(event_pb2.Event(summary=summary, step=step,
                                                     wall_time=time.time()))
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
    self._add(step, [scalar(prefix + key, value) for key, value in values.items()
                     if isinstance(value, (int, float))])

  def write_text(self, step: int, tag: str, markdown: str):
    """Text for TensorBoard's Text tab (rendered as markdown), under `tag` at `step`."""
    if self.enabled:
      self._add(step, [text(tag, markdown)])

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
