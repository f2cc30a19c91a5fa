r"""The attention alone, forward and backward, each implementation timed in turn in one process:
XLA's (flax's `nn.dot_product_attention`, as the model calls it), cuDNN's (on a GPU) and
transformer/fused_attention.py's Pallas kernels at each number of Triton warps and of queries per
backward step.

  python -m benchmarks.attention_speed [--shape=192x128] [--warps=4,8,16] [--backward_rows=0,32]
      [--repeats=20]

One call is a decoder layer's three attentions at the paper's base size (8 heads of 64, bfloat16):
the encoder's self-attention, the decoder's causal self-attention and its cross-attention, over
the masks of a batch packed as train.py packs Multi30k-length pairs (benchmarks.workload's
packed_batch), with the gradients of the query, key and value. Each round times one call of every
implementation, the order rotated; times are medians, ratios the median of the rounds' time
ratios to the first implementation (cuDNN's on a GPU, else XLA's): below 1, faster. Model TFLOP/s
count the 2 matmuls forward and 5 backward (the scores again) over every [query, key] pair; the
gradients' difference is the relative norm of their difference from the first's. An
implementation that fails is listed with its error. Writes
benchmarks/results/attention_speed.{json,md}.
"""

import os
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.measure import machine, machine_name, ratios, round_robin, write_results
from benchmarks.workload import packed_batch, parse_shape
from transformer import fused_attention, model

FLAGS = flags.FLAGS
HEADS, DEPTH = 8, 64


def masks(rows: int, length: int) -> list:
  """The encoder's, the decoder's causal and the cross-attention's [rows, 1, length, length] masks
  of a packed batch."""
  batch = {name: jnp.asarray(x) for name, x in
           packed_batch(np.random.default_rng(0), rows, length, 16000).items()}
  sources, targets = batch['sources'], batch['targets']
  source_segments, target_segments = batch['source_segment_ids'], batch['target_segment_ids']
  return [model.attention_mask(sources, sources, source_segments, source_segments),
          model.attention_mask(targets, targets, target_segments, target_segments, causal=True),
          model.attention_mask(targets, sources, target_segments, source_segments)]


def implementations(warps: list[int], backward_rows: list[int]) -> dict:
  """{name: attention(query, key, value, mask)}, those this backend runs: the Pallas kernels at
  each number of warps and of queries per backward step (0: all)."""
  found = {'xla': lambda q, k, v, mask: nn.dot_product_attention(
      q, k, v, mask=mask, dtype=q.dtype, force_fp32_for_softmax=True).astype(q.dtype)}
  if jax.default_backend() == 'gpu':
    found = {'cudnn': lambda q, k, v, mask: jax.nn.dot_product_attention(
        q, k, v, mask=mask.astype(bool), implementation='cudnn'), **found}
  for count in warps:
    for rows in backward_rows:
      name = f'pallas, {count} warps' + (f', backward by {rows} queries' if rows else '')
      found[name] = lambda q, k, v, mask, count=count, rows=rows: fused_attention.attention(
          q, k, v, mask, count, rows)
  return found


def main(argv):
  del argv
  rows, length = parse_shape(FLAGS.shape)
  layer_masks = masks(rows, length)
  inputs = jax.random.normal(jax.random.key(0), (4, rows, length, HEADS, DEPTH), jnp.bfloat16)
  calls, grads, failed = {}, {}, {}
  integers = lambda text: [int(n) for n in text.split(',') if n]
  for name, attention in implementations(integers(FLAGS.warps),
                                         integers(FLAGS.backward_rows)).items():
    def layer(q, k, v, d_out, attention=attention):
      grads = []
      for mask in layer_masks:
        _, backward = jax.vjp(lambda q, k, v: attention(q, k, v, mask), q, k, v)
        # No gradient reaches a query that attends to nothing (padding), as in the model.
        grads.append(backward(d_out * mask.any(-1)[:, 0, :, None, None].astype(d_out.dtype)))
      return grads
    step = jax.jit(layer)
    calls[name] = lambda step=step: jax.block_until_ready(step(*inputs))
    try:  # one implementation that fails to compile or run still leaves the others' figures
      grads[name] = calls[name]()  # compiles
    except Exception as error:
      failed[name] = f'{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}'
      del calls[name]
  times = round_robin(calls, FLAGS.repeats)
  first = next(iter(times))
  pairs = sum(float(mask.sum()) for mask in layer_masks) * HEADS  # attended pairs
  flops = 7 * 2 * rows * length * length * HEADS * DEPTH * len(layer_masks)
  results = {'machine': machine(), 'shape': FLAGS.shape, 'repeats': FLAGS.repeats,
             'attended_share': pairs / (len(layer_masks) * rows * length * length * HEADS),
             'implementations': {}, 'failed': failed}
  flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float32))
                                      for x in jax.tree_util.tree_leaves(tree)])
  for name, (ratio, ratio_range) in ratios(times, first).items():
    secs = statistics.median(times[name])
    # Gradients that differ from the first implementation's by more than bfloat16's roundings
    # would make a time meaningless.
    difference = (np.linalg.norm(flat(grads[name]) - flat(grads[first])) /
                  np.linalg.norm(flat(grads[first])))
    results['implementations'][name] = {'secs': secs, 'tflops': flops / secs / 1e12,
                                        'ratio': ratio, 'ratio_range': ratio_range,
                                        'gradient_difference': float(difference)}
  write_results(FLAGS.output, FLAGS.name, results, markdown(results, first))


def markdown(results: dict, first: str) -> str:
  lines = [
      f'A decoder layer\'s three attentions, forward and backward, {results["shape"]} packed '
      f'rows, {HEADS} heads of {DEPTH}, bfloat16 ({100 * results["attended_share"]:.1f}% of the '
      f'[query, key] pairs attended), {results["repeats"]} rounds on '
      f'{machine_name(results["machine"])}. Times are medians; time x {first} the median of the '
      'rounds\' ratios (lowest-highest in brackets).',
      '',
      f'| attention | ms | model TFLOP/s | time x {first} | gradients vs {first}\'s |',
      '| --- | --- | --- | --- | --- |']
  for name, row in results['implementations'].items():
    low, high = row['ratio_range']
    lines.append(f'| {name} | {1e3 * row["secs"]:.3f} | {row["tflops"]:.1f} | '
                 f'{row["ratio"]:.2f}x ({low:.2f}-{high:.2f}) | '
                 f'{100 * row["gradient_difference"]:.2f}% |')
  for name, error in results['failed'].items():
    lines.append(f'| {name} | failed: {error} | | | |')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  flags.DEFINE_string('shape', '192x128', 'Packed rows x length.')
  flags.DEFINE_string('warps', '4,8,16', "Comma-separated Triton warps, a Pallas run's each.")
  flags.DEFINE_string('backward_rows', '0,32',
                      'Comma-separated queries per backward step, a Pallas run at each warps each '
                      '(0: all at once).')
  flags.DEFINE_integer('repeats', 20, 'Rounds timed; each runs every implementation once.')
  flags.DEFINE_string('name', 'attention_speed', 'Results go to <name>.json and <name>.md.')
  flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                      'Where the results go.')
  app.run(main)
