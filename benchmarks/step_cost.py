r"""What a config change costs per training step: our train step with configs/multi30k.py as it is
and with each variant's overrides, timed in turn in one process on the same random batch.

  python -m benchmarks.step_cost --variant='model.d_model=384 model.d_ff=1536 model.num_heads=6'
      [--variant=...] [--shape=32x64] [--repeats=9]

A variant is train.py's `--config.key=value` overrides without the `--config.` prefix, parsed by
the same flag. Each round times one step of every config, the order rotated each round; a
variant's cost is the median over rounds of its step time over the recipe's in the same round. The
batch is vs_flax.py's (lengths uniform in [L/2, L], so ~75% real tokens), drawn alike for every
config. Also: the parameters each real source and target token passes through, whose sum sets the
model FLOPs per token (6 per parameter with the backward pass). Writes
benchmarks/results/step_cost.{json,md}.
"""

import os
import statistics

import jax
import numpy as np
from absl import app, flags

from benchmarks.measure import machine, machine_name, ratios, round_robin, write_results
from benchmarks.workload import Ours, import_ours, load_config, parse_shape, random_batch

FLAGS = flags.FLAGS
RECIPE = '(the recipe)'


def costs(times: dict) -> dict:
  """{variant: median step seconds, and the median and range of its per-round ratio to the
  recipe's}, from round_robin's times."""
  return {name: {'step_secs': statistics.median(times[name]), 'ratio': ratio,
                 'ratio_range': ratio_range}
          for name, (ratio, ratio_range) in ratios(times, RECIPE).items()}


def main(argv):
  del argv
  rows, length = parse_shape(FLAGS.shape)
  modules = import_ours('')
  steps, results = {}, {'machine': machine(), 'shape': FLAGS.shape, 'repeats': FLAGS.repeats,
                        'variants': {}}
  for variant in ['', *FLAGS.variant]:
    name = variant or RECIPE
    try:
      ours = Ours(modules, load_config(variant))
    except modules.config.ConfigError as error:
      raise SystemExit(f'--variant={variant!r}: {error}') from None
    batch = random_batch(np.random.default_rng(0), rows, length, ours.model_config.vocab_size)
    sharded = jax.tree_util.tree_map(
        lambda x: x.reshape(jax.local_device_count(), -1, x.shape[-1]), batch)
    steps[name] = lambda ours=ours, sharded=sharded: ours.train(sharded)
    steps[name]()  # compiles
    results['variants'][name] = {'parameters_per_token': list(ours.parameters)}
  for name, cost in costs(round_robin(steps, FLAGS.repeats)).items():
    results['variants'][name].update(cost)
  write_results(FLAGS.output, 'step_cost', results, markdown(results))


def markdown(results: dict) -> str:
  variants = results['variants']
  recipe_parameters = sum(variants[RECIPE]['parameters_per_token'])
  lines = [
      f'One training step of a {results["shape"]} random batch (~75% real tokens), '
      f'{results["repeats"]} rounds on {machine_name(results["machine"])}: each round times '
      'every config once. Step seconds are medians; step x recipe is the median of the '
      'rounds\' ratios (lowest-highest in brackets).',
      '',
      '| config overrides | parameters per source / target token | parameters x recipe | '
      'step (s) | step x recipe |',
      '| --- | --- | --- | --- | --- |']
  for name, v in variants.items():
    source, target = v['parameters_per_token']
    low, high = v['ratio_range']
    lines.append(f'| {name} | {source:,} / {target:,} | '
                 f'{(source + target) / recipe_parameters:.2f}x | {v["step_secs"]:.3f} | '
                 f'{v["ratio"]:.2f}x ({low:.2f}-{high:.2f}) |')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  flags.DEFINE_multi_string('variant', [], 'Space-separated key=value overrides of one variant.')
  flags.DEFINE_string('shape', '32x64', 'Training batch, rows x length.')
  flags.DEFINE_integer('repeats', 9, 'Rounds timed; each runs every config once.')
  flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                      'Where step_cost.json and step_cost.md go.')
  app.run(main)
