r"""Our train step and beam search against flax's examples/wmt, like for like and as each ships,
timed alternately in one process.

  python -m benchmarks.vs_flax [--size=multi30k|base] [--variant='key=value ...'] [--repeats=15]
      [--train_shapes=128x32,...] [--steps_per_call=5,...] [--beam_shape=64x24 or '']
      [--name=vs_flax] [--flax_dir=DIR]

The reference is the `examples/wmt/` of the flax sdist of the installed version, fetched once with
`pip download flax==<version> --no-deps --no-binary :all:` into --flax_dir. Its train.py imports
tensorflow and clu at top level for its input pipeline and logging, which are not timed: they and
its tf.data input_pipeline are stubbed in `sys.modules` rather than installed.

Both models have the size of --size: configs/multi30k.py (d_model 256, d_ff 512, 4 heads, 2 + 2
layers, float32) or configs/default.py, the paper's base (d_model 512, d_ff 2048, 8 heads, 6 + 6
layers, bfloat16), each with its shared vocabulary tied to the output; flax's in the same dtype,
with our dropout rate. Two pairs are timed:

- like for like ('ours' against 'flax'): our config shaped as flax's model (`workload.like_flax`:
  dropout also on the feed-forward hidden layer, pre-norm layers, the output projection in
  float32), and both train steps compiled with our config's `xla_flags` (configs/default.py turns
  Triton's matmuls off; as options of each program, see `workload.with_options`). Before timing,
  the two must have the same parameter count, dropout sites and dtypes (`workload.differences`),
  or the run stops.
- as shipped ('ours as shipped' against 'flax as shipped'): our config as it is, with its
  `xla_flags`, against flax's model with XLA's defaults; what differs is listed with the results.

Each --variant adds one more of ours, the like-for-like config with those overrides (train.py's
--config.key=value without the prefix), timed against 'flax'. Both run on the same random batches:
each side of each row has a length drawn uniformly from [L/2, L], so about 75% of the slots are
real tokens, as in the length buckets of Multi30k. Each round times every side once (the order
rotating); times are medians and each ratio is the median of the rounds' ratios.

- train: one pmapped training step (forward, backward, Adam), each side's own `train_step`. For
  each N in --steps_per_call (at least 5 for a headline) a row in which each timed call runs N
  steps and waits only for the last, as a training loop does: the dispatch and wait that a lone
  step adds (milliseconds on a GPU) overlap the device's work. Times are per step. Also each
  side's time until its call's first step returned to Python: the host's work for a step (its
  arguments, the launch of its program), which a lone step waits for.
- beam: beam search, beam 4, alpha 0.6, on 64 sentences of 24 tokens, decoded to the length
  limit (source + 50 tokens) by both like-for-like models: the EOS row of each side's embedding is
  zeroed, so EOS is never a top candidate, and our search reports how many steps it ran. Flax's
  time includes its cache set-up (`initialize_cache`), as in its own translate loop.

Also measured in the same run: this machine's jitted matmul peak in the models' dtype, and each
side's model FLOP/s (2 FLOPs per parameter and real token forward, 6 with the backward pass; the
same count for both sides). Writes benchmarks/results/<name>.{json,md}.
"""

import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.measure import (machine, machine_name, matmul_peak, round_robin, tflops,
                                write_results)
from benchmarks.workload import (ALPHA, BEAM_SIZE, EXTRA_LENGTH, Flax, Ours,
                                 define_workload_flags, differences, fetch_flax_examples,
                                 like_flax, load_config, parse_shape, random_batch)
from transformer import decode

_REPEATS = flags.DEFINE_integer('repeats', 15, 'Rounds timed; each runs both sides once.')
_TRAIN_SHAPES = flags.DEFINE_list('train_shapes', ['128x32', '64x64', '256x16'],
                                  'Training batches, rows x length.')
_STEPS_PER_CALL = flags.DEFINE_list(
    'steps_per_call', ['5'], 'Training steps per timed call, waiting only for the last: a row '
    'for each.')
_BEAM_SHAPE = flags.DEFINE_string('beam_shape', '64x24',
                                  "Beam search batch, sentences x length; '' for none.")


def alternate(sides: dict, references: dict, repeats: int) -> dict:
  """{side: median seconds per step, and for each in `references` the ratio of its reference's
  time to its own: the median of the ratios within each of `repeats` rounds of `round_robin`};
  `sides` maps names to (call, steps each call runs)."""
  times = round_robin({name: call for name, (call, _) in sides.items()}, repeats)
  per_step = {name: [secs / sides[name][1] for secs in times[name]] for name in sides}
  result = {name: {'secs': statistics.median(secs)} for name, secs in per_step.items()}
  for name, reference in references.items():
    ratios = sorted(f / o for o, f in zip(per_step[name], per_step[reference]))
    result[name].update(reference=reference, speedup=statistics.median(ratios),
                        speedup_range=[ratios[0], ratios[-1]])
  return result


def main(argv):
  del argv
  directory = fetch_flax_examples(_FLAX_DIR.value)  # first: without it, nothing to compare
  repeats = _REPEATS.value
  rng = np.random.default_rng(0)
  shipped_config = load_config('', _SIZE.value)
  ours = {variant or 'ours': Ours(like_flax(load_config(variant, _SIZE.value)))
          for variant in ['', *_VARIANTS.value]}
  mine, shipped = ours['ours'], Ours(shipped_config)
  flax_sides = {'flax': Flax(directory, mine, mine.compiler_options),
                'flax as shipped': Flax(directory, shipped)}
  check_batch = random_batch(rng, 2, 8, mine.model_config.vocab_size)
  unlike = differences(mine, flax_sides['flax'], check_batch)
  if unlike:
    raise SystemExit(f'ours and flax differ, so a comparison would not be like for like: {unlike}')
  sides = {**ours, 'ours as shipped': shipped, **flax_sides}
  references = {**{name: 'flax' for name in ours}, 'ours as shipped': 'flax as shipped'}
  encoder_params, decoder_params = mine.parameters
  peak = matmul_peak(repeats, mine.model_config.dtype)
  results = {
      'machine': machine(), 'size': _SIZE.value, 'dtype': jnp.dtype(mine.model_config.dtype).name,
      'matmul_peak_flops_per_sec': peak['flops_per_sec'], 'matmul_peak_size': peak['size'],
      'repeats': repeats, 'xla_options': mine.compiler_options,
      'as_shipped_differences': differences(shipped, flax_sides['flax as shipped'], check_batch),
      'train': [], 'beam': {}}

  for shape in map(parse_shape, _TRAIN_SHAPES.value):
    batch = random_batch(rng, *shape, mine.model_config.vocab_size)
    sharded = jax.tree_util.tree_map(lambda x: x[None], batch)
    flops = 6 * (encoder_params * (batch['sources'] > 0).sum() +
                 decoder_params * (batch['targets'] > 0).sum())
    for steps in map(int, _STEPS_PER_CALL.value):
      calls = {name: functools.partial(side.train, sharded, steps) for name, side in sides.items()}
      for fn in calls.values():  # compile, and a first call off the clock
        fn()
        fn()
      returned = {name: [] for name in calls}  # seconds each call's first step took to return
      recording = {name: (lambda fn=fn, out=returned[name]: out.append(fn()), steps)
                   for name, fn in calls.items()}
      timings = alternate(recording, references, repeats)
      results['train'].append({
          'shape': 'x'.join(map(str, shape)),
          'steps_per_call': steps,
          'real_token_fraction': float((batch['targets'] > 0).mean()),
          'sides': {name: {**timing, 'call_returns_secs': statistics.median(returned[name]),
                           'model_flops_per_sec': float(flops / timing['secs'])}
                    for name, timing in timings.items()}})

  if _BEAM_SHAPE.value:
    results['beam'] = beam(mine, flax_sides['flax'], rng, repeats)
  write_results(_OUTPUT.value, _NAME.value, results, markdown(results))


def beam(ours: Ours, reference: Flax, rng: np.random.Generator, repeats: int) -> dict:
  """Both beam searches on --beam_shape random sentences, decoded to the length limit."""
  encoder_params, decoder_params = ours.parameters
  sentences, length = parse_shape(_BEAM_SHAPE.value)
  sources = jnp.asarray(rng.integers(3, ours.model_config.vocab_size, (sentences, length)),
                        jnp.int32).at[:, -1].set(decode.EOS_ID)
  our_params, flax_params = ours.beam_params(), reference.beam_params()
  _, steps = ours.beam_search(our_params, sources, BEAM_SIZE, ALPHA, EXTRA_LENGTH)
  flax_tokens = np.asarray(reference.beam_search(flax_params, sources))
  limit = length + EXTRA_LENGTH
  if steps != limit or (flax_tokens == decode.EOS_ID).any():
    raise RuntimeError(f'a search stopped early (ours after {steps} of {limit} steps): the two '
                       'sides would not decode as many tokens')
  beam_args = BEAM_SIZE, ALPHA, EXTRA_LENGTH
  flops = 2 * (encoder_params * sources.size + decoder_params * sentences * BEAM_SIZE * limit)
  timing = alternate({'ours': (lambda: ours.beam_search(our_params, sources, *beam_args), 1),
                      'flax': (lambda: reference.beam_search(flax_params, sources), 1)},
                     {'ours': 'flax'}, repeats)
  return {'shape': _BEAM_SHAPE.value, 'beam_size': BEAM_SIZE, 'steps': limit,
          'sides': {name: {**t, 'model_flops_per_sec': float(flops / t['secs'])}
                    for name, t in timing.items()}}


def markdown(results: dict) -> str:
  peak = results['matmul_peak_flops_per_sec']

  def returns(side: dict) -> str:
    return f'{side["call_returns_secs"] * 1e3:.2f}' if 'call_returns_secs' in side else '-'

  def rows(step: str, r: dict) -> list[str]:
    lines = []
    for name, side in r['sides'].items():
      if 'reference' not in side:
        continue
      flax = r['sides'][side['reference']]
      low, high = side['speedup_range']
      label = {'ours': 'like for like'}.get(name, name)
      lines.append(
          f'| {step} | {r["shape"]} | {label} | {side["secs"] * 1e3:.1f} | '
          f'{flax["secs"] * 1e3:.1f} | {side["speedup"]:.2f}x ({low:.2f}-{high:.2f}) | '
          f'{tflops(side["model_flops_per_sec"], peak)} | '
          f'{tflops(flax["model_flops_per_sec"], peak)} | {returns(side)} / {returns(flax)} |')
    return lines

  beam = results['beam']
  beam_rows = rows(f'beam {beam["beam_size"]}, {beam["steps"]} steps', beam) if beam else []
  shipped = '; '.join(f'{what}: ours {mine}, flax\'s {theirs}' for what, (mine, theirs)
                      in results['as_shipped_differences'].items())
  options = ' '.join(f'{k}={v}' for k, v in results['xla_options'].items()) or "XLA's defaults"
  return '\n'.join([
      f'{results["size"]} size, {results["dtype"]}; {results["repeats"]} rounds on '
      f'{machine_name(results["machine"])}, jax {results["machine"]["jax"]}, flax '
      f'{results["machine"]["flax"]}; each round times every side once. Milliseconds are '
      f'medians per step; flax / ours is the median of the rounds\' ratios (lowest-highest in '
      f'brackets). {results["dtype"]} matmul peak {peak / 1e12:.1f} TFLOP/s '
      f'({results["matmul_peak_size"]}^2); '
      'model TFLOP/s in brackets: % of that peak. A call returns: milliseconds until a '
      "call's first step returned to Python, the host's work for it (median).",
      '',
      '- like for like: our model shaped as flax\'s (`benchmarks.workload.like_flax`), the same '
      'parameter count, dropout sites and dtypes (`workload.differences`), both compiled with '
      f'{options}; variants add overrides to it.',
      f'- as shipped: our config against flax\'s model with XLA\'s defaults. They differ in '
      f'{shipped or "nothing"}.',
      '',
      '| step | batch | ours | ours (ms) | flax examples/wmt (ms) | '
      'flax / ours | ours TFLOP/s | flax TFLOP/s | a call returns, ours / flax (ms) |',
      '| --- | --- | --- | --- | --- | --- | --- | --- | --- |',
      *(line for r in results['train'] for line in rows(
          f'train, {r["steps_per_call"]} steps per call', r)),
      *beam_rows]) + '\n'


if __name__ == '__main__':
  _SIZE, _VARIANTS, _FLAX_DIR, _NAME, _OUTPUT = define_workload_flags(
      'vs_flax', 'each one more of ours, on top of the like-for-like config')
  app.run(main)
