"""Training metrics: from per-step token sums to rates, written to metrics.jsonl and TensorBoard."""

import json
import math
import os
import time

import numpy as np
from tensorboardX import SummaryWriter

from transformer.files import append_line


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
      self.tensorboard = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, values: dict, split: str | None = None):
    if not self.enabled:
      return
    # 'time' (seconds since the epoch) puts the curves against wall-clock time (transformer.plots).
    row = {'step': step, **({'split': split} if split else {}), 'time': time.time(), **values}
    append_line(self.path, json.dumps(row))
    prefix = f'{split}/' if split else 'train/'
    for key, value in values.items():
      if isinstance(value, (int, float)):
        self.tensorboard.add_scalar(prefix + key, value, step)
    self.tensorboard.flush()

  def write_text(self, step: int, tag: str, markdown: str):
    """Text for TensorBoard's Text tab (rendered as markdown), under `tag` at `step`."""
    if self.enabled:
      self.tensorboard.add_text(tag, markdown, step)
      self.tensorboard.flush()

  def close(self):
    if self.enabled:
      self.tensorboard.close()


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
