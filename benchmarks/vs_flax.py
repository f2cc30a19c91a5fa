r"""Our train step and beam search against flax's examples/wmt, like for like and as each ships,
timed alternately in one process.

  python -m benchmarks.vs_flax [--size=multi30k|base] [--variant='key=value ...'] [--repeats=15]
      [--train_shapes=128x32,...] [--steps_per_call=5,...] [--beam_shape=64x24 or '']
      [--name=vs_flax] [--flax_dir=DIR]

The reference is examples/wmt of the installed flax version's sdist, fetched once into --flax_dir.
Pairs timed on random batches (each row's length uniform in [L/2, L]): 'ours' against 'flax' like
for like (checked before timing, `workload.differences`), each --variant (overrides of the
like-for-like config) against 'flax', and 'ours as shipped' against 'flax as shipped';
docs/speed.md ("Like for like") says what each holds equal. Times are medians per step over rounds
that time every side once, the order rotating; ratios are medians of the rounds' ratios. A train
row's calls run --steps_per_call steps each, waiting for the last. The beam searches (beam 4,
alpha 0.6) run to the length limit, source + 50 tokens: EOS's row of each embedding is zeroed.
Model FLOP/s count 6 FLOPs per parameter and real token (2 in the beam search), against this
machine's matmul peak. Writes benchmarks/results/<name>.{json,md}.
"""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.measure import (machine, machine_name, matmul_peak, round_robin, tflops,
                                write_results)
from benchmarks.workload import (BEAM_SIZE, EXTRA_LENGTH, Flax, Ours, define_workload_flags,
                                 differences, fetch_flax_examples, like_flax, load_config,
                                 parse_shape, random_batch)
from transformer import decode, metrics

_REPEATS = flags.DEFINE_integer('repeats', 15, 'Rounds timed; each runs both sides once.')
_TRAIN_SHAPES = flags.DEFINE_list('train_shapes', ['128x32', '64x64', '256x16'],
                                  'Training batches, rows x length.')
_STEPS_PER_CALL = flags.DEFINE_list(
    'steps_per_call', ['5'], 'Training steps per timed call, waiting only for the last: a row '
    'for each.')
_BEAM_SHAPE = flags.DEFINE_string('beam_shape', '64x24',
                                  "Beam search batch, sentences x length; '' for none.")


def alternate(calls: dict, references: dict, repeats: int, steps: int = 1) -> dict:
  """{name: median seconds per step of `calls[name]()`, which runs `steps` steps, and for each in
  `references` the ratio of its reference's time to its own: the median of the ratios within each
  of `repeats` rounds of `round_robin`}."""
  times = round_robin(calls, repeats)
  per_step = {name: [secs / steps for secs in times[name]] for name in calls}
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
    flops = metrics.model_flops(mine.parameters, (batch['sources'] > 0).sum(),
                                (batch['targets'] > 0).sum())
    for steps in map(int, _STEPS_PER_CALL.value):
      for side in sides.values():  # compile, and a first call off the clock
        side.train(sharded, steps)
        side.train(sharded, steps)
      returned = {name: [] for name in sides}  # seconds each call's first step took to return
      calls = {name: lambda side=side, out=returned[name]: out.append(side.train(sharded, steps))
               for name, side in sides.items()}
      timings = alternate(calls, references, repeats, steps)
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
  sentences, length = parse_shape(_BEAM_SHAPE.value)
  sources = jnp.asarray(rng.integers(3, ours.model_config.vocab_size, (sentences, length)),
                        jnp.int32).at[:, -1].set(decode.EOS_ID)
  our_params, flax_params = ours.beam_params(), reference.beam_params()
  _, steps = ours.beam_search(our_params, sources)
  flax_tokens = np.asarray(reference.beam_search(flax_params, sources))
  limit = length + EXTRA_LENGTH
  if steps != limit or (flax_tokens == decode.EOS_ID).any():
    raise RuntimeError(f'a search stopped early (ours after {steps} of {limit} steps): the two '
                       'sides would not decode as many tokens')
  flops = metrics.model_flops(ours.parameters, sources.size, sentences * BEAM_SIZE * limit,
                              backward=False)
  timing = alternate({'ours': lambda: ours.beam_search(our_params, sources),
                      'flax': lambda: reference.beam_search(flax_params, sources)},
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
