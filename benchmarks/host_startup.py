r"""Seconds one host spends reading and tokenizing its shards of Multi30k's training split.

Each host reads only its own devices' shards, so the start-up cost per host falls with the number
of hosts. Host 0 of 1, 2 and 4 hosts (one device each) builds its training batches; the other
hosts' shard tables are taken to be host 0's, so that one process can stand in for all of them:

  python -m benchmarks.host_startup --manual_dir=../shared/data/multi30k
"""

import os
import tempfile
import time

import numpy as np
from absl import app, flags

from configs import multi30k
from transformer import config as config_lib
from transformer import data

_MANUAL_DIR = flags.DEFINE_string('manual_dir', '../shared/data/multi30k',
                                  'Directory of the Multi30k files.')
_PROCESS_COUNTS = flags.DEFINE_list('process_counts', ['1', '2', '4'], 'Host counts to time.')


def main(argv):
  del argv
  config = multi30k.get_config()
  config.manual_dir = _MANUAL_DIR.value
  with tempfile.TemporaryDirectory() as tmp:
    config.tfds_data_dir = os.path.join(tmp, 'tfds')
    config_lib.validate(config)
    vocab = data.load_or_train_vocabulary(config, tmp)
    data.split_texts(config, 'train')  # prepares the TFDS files outside the timing
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
