r"""Padding efficiency (real tokens / padded slots) of one training epoch on Multi30k EN->DE.

Compares length buckets with sequence packing (the default), using configs/multi30k.py, with the
data sharded over 1 and over 8 devices (each device fills its rows from its own shard, so more
devices leave a few more rows empty):

  python -m benchmarks.padding_efficiency --manual_dir=../shared/data/multi30k
"""

import itertools

from absl import app, flags

from benchmarks.multi30k_setup import multi30k_config_and_vocab
from transformer import data

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the vocabulary goes (default: a temp dir).')
_NUM_DEVICES = flags.DEFINE_list('num_devices', ['1', '8'], 'Device counts to shard the data over.')


def main(argv):
  del argv
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
      print(f'{num_devices} device(s), {"packing" if packing else "buckets"}: '
            f'{100 * sum(real.values()) / (2 * slots):.1f}% (sources '
            f'{100 * real["sources"] / slots:.1f}%, targets {100 * real["targets"] / slots:.1f}%), '
            f'{batches.batches_per_epoch} batches, {len(shapes)} shapes')


if __name__ == '__main__':
  app.run(main)
