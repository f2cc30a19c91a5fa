r"""Seconds one host spends reading and tokenizing its shards of Multi30k's training split.

Each host reads only its own devices' shards, so the start-up cost per host falls with the number
of hosts. Host 0 of 1, 2 and 4 hosts (one device each) builds its training batches; the other
hosts' shard tables are taken to be host 0's, so that one process can stand in for all of them:

  python -m benchmarks.host_startup --manual_dir=../shared/data/multi30k
"""

import time

import numpy as np
from absl import app, flags

from benchmarks.multi30k_setup import multi30k_config_and_vocab
from transformer import data

_PROCESS_COUNTS = flags.DEFINE_list('process_counts', ['1', '2', '4'], 'Host counts to time.')


def main(argv):
  del argv
  with multi30k_config_and_vocab() as (config, vocab):
    baseline = None
    for process_count in map(int, _PROCESS_COUNTS.value):
      start = time.perf_counter()
      data.train_batches(config, vocab, process_index=0, process_count=process_count,
                         all_gather=lambda local, n=process_count: np.tile(local, (n, 1)))
      secs = time.perf_counter() - start
      baseline = baseline or secs
      print(f'{process_count} host(s): host 0 ready in {secs:.2f} s (speed-up '
            f'{baseline / secs:.2f}x over 1 host)')


if __name__ == '__main__':
  app.run(main)
