"""What the benchmarks share: configs/multi30k.py over a local Multi30k and its vocabulary."""

import contextlib
import os
import tempfile

from absl import flags

from configs import multi30k
from transformer import config as config_lib
from transformer import data

MANUAL_DIR = flags.DEFINE_string('manual_dir', '../shared/data/multi30k',
                                 'Directory of the Multi30k files.')


@contextlib.contextmanager
def multi30k_config_and_vocab(vocab_workdir: str | None = None):
  """(config, vocabulary); the TFDS files (and the vocabulary, by default) in a temp dir."""
  config = multi30k.get_config()
  config.manual_dir = MANUAL_DIR.value
  with tempfile.TemporaryDirectory() as tmp:
    config.tfds_data_dir = os.path.join(tmp, 'tfds')
    config_lib.validate(config)
    yield config, data.load_or_train_vocabulary(config, vocab_workdir or tmp)
