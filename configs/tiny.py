r"""A tiny Transformer on a synthetic stream: seconds per run on a CPU, for tests and quick checks.

  python train.py --config=configs/tiny.py --workdir=/tmp/tiny

The argument, a language pair (default en-de), names the languages of files read with
--config.dataset=text (configs/tiny.py:de-en): recipes for Multi30k run at this size so.
"""

from configs import default


def get_config(pair: str = 'en-de'):
  config = default.get_config()
  config.dataset = 'synthetic'  # generated pairs; --config.dataset=multi30k for real text
  config.source_lang, config.target_lang = pair.split('-', 1)
  config.vocab_size = 320  # 259 byte and special pieces, and ~60 learned from 8 letters
  config.max_length = 16
  config.tokens_per_batch = 1024
  config.packing = True  # one batch shape: one train step to compile
  # A split's sentences in one beam-search call: one shape.
  config.implementation.decode_batch_tokens = 4096
  config.model.update(dict(
      d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
      max_positions=128, dtype='float32'))
  config.lr_scale = 0.3  # the paper's schedule peaks at 0.056 for d_model 32: too high here
  config.warmup_steps = 20
  config.num_train_steps = 100
  config.log_every_steps = 20
  config.eval_every_steps = 50
  config.bleu_every_steps = 0
  config.checkpoint_every_steps = 50
  config.checkpoint_every_secs = 0
  config.keep_checkpoints = 2
  config.average_last = 2
  return config
