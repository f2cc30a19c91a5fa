r"""Padding efficiency (real tokens / padded slots) of one training epoch on Multi30k EN->DE.

Compares length buckets with sequence packing (the default), using configs/multi30k.py, with the
data sharded over 1 and over 8 devices (each device fills its rows from its own shard, so more
devices leave a few more rows empty):

  python -m benchmarks.padding_efficiency --manual_dir=../shared/data/multi30k
"""

import itertools
import os

from absl import app, flags

from benchmarks.measure import write_results
from benchmarks.multi30k_setup import multi30k_config_and_vocab
from transformer import data

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the vocabulary goes (default: a temp dir).')
_NUM_DEVICES = flags.DEFINE_list('num_devices', ['1', '8'], 'Device counts to shard the data over.')
_OUTPUT = flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                              'Where padding_efficiency.json and .md go.')


def main(argv):
  del argv
  results = []
  with multi30k_config_and_vocab(_WORKDIR.value) as (config, vocab):
    for num_devices, packing in itertools.product(map(int, _NUM_DEVICES.value), (False, True)):
      config.packing = packing
      batches = data.train_batches(config, vocab, num_devices=num_devices)
      real, slots, shapes = {'sources': 0, 'targets': 0}, 0, set()
      for _ in range(batches.batches_per_epoch):
        batch = next(batches)
        for side in real:
          real[side] += int((batch[side] > 0).sum())
        slots += batch['sources'].size
        shapes.add(batch['sources'].shape)
      results.append({'devices': num_devices, 'packing': packing,
                      'real_share': sum(real.values()) / (2 * slots),
                      'sources_real_share': real['sources'] / slots,
                      'targets_real_share': real['targets'] / slots,
                      'batches': batches.batches_per_epoch, 'shapes': len(shapes),
                      'tokens_per_batch': config.tokens_per_batch})
  write_results(_OUTPUT.value, 'padding_efficiency', results, markdown(results))


def markdown(results: list[dict]) -> str:
  cell = lambda r: (f'{100 * r["real_share"]:.1f}% real tokens ({r["batches"]} batches, '
                    f'{r["shapes"]} shape{"s" if r["shapes"] > 1 else ""})')
  lines = [f'One epoch of Multi30k EN->DE training batches, configs/multi30k.py '
           f'(tokens_per_batch={results[0]["tokens_per_batch"]}):', '',
           '| devices | length buckets | packing |', '| --- | --- | --- |']
  for devices in dict.fromkeys(r['devices'] for r in results):
    by_packing = {r['packing']: r for r in results if r['devices'] == devices}
    lines.append(f'| {devices} | {cell(by_packing[False])} | {cell(by_packing[True])} |')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  app.run(main)
