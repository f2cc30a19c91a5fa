r"""The paper's WMT14 experiments (Table 2): model size and language pair as an argument. The BLEU
figures are the paper's on newstest2014; none has been run here yet.

  base,en-de  27.3 BLEU (same as configs/default.py)
  big,en-de   28.4 BLEU: d_model 1024, d_ff 4096, 16 heads, P_drop 0.3, 300k steps, average last 20
  base,en-fr  38.1 BLEU: 36M pairs, 32000 word-piece vocabulary
  big,en-fr   41.0 BLEU (41.8 in the arXiv v5 Table 2): big with P_drop 0.1

  python prepare.py --config=configs/wmt14.py:big,en-de  # once: dataset, vocabulary, token ids
  python train.py --config=configs/wmt14.py:big,en-de --workdir=runs/big_ende

Cloud TPU slices each was compiled for here, as configs/default.py's (base,en-de) were
(`python tpu_plan.py --config=configs/wmt14.py:big,en-de --topology=v4:2x2x4`; all:
benchmarks/results/tpu_plan.md), with the share of a device's memory the largest train program
and beam search take:
  big,en-de on v4-32: fits; train step 19%, beam search 44%
  big,en-de on v5e-4: fits; train step 64%, beam search 89%
  big,en-de on v5e-1: does not fit; train step 115%, beam search 92% (tpu_plan: raise
    grad_accum_steps to 2)
  base,en-fr on v5e-8: fits; train step 19%, beam search 43%
  big,en-fr on v4-32: fits; train step 20%, beam search 41%
"""

from configs import default


def get_config(arg: str = 'base,en-de'):
  size, pair = arg.split(',')
  config = default.get_config()
  if pair == 'en-fr':
    config.dataset = 'wmt14_translate/fr-en'
    config.target_lang = 'fr'
    config.vocab_size = 32000
  elif pair != 'en-de':
    raise ValueError(f"configs/wmt14.py:{arg}: language pair must be 'en-de' or 'en-fr'")
  if size == 'big':
    config.model.d_model = 1024
    config.model.d_ff = 4096
    config.model.num_heads = 16
    config.model.dropout_rate = 0.3 if pair == 'en-de' else 0.1
    config.num_train_steps = 300_000
    config.checkpoint_every_steps = 600  # 10 minutes of the paper's big steps (300k in 3.5 days)
    config.keep_checkpoints = 20
    config.average_last = 20  # section 6.1: big models average the last 20 checkpoints
  elif size != 'base':
    raise ValueError(f"configs/wmt14.py:{arg}: model size must be 'base' or 'big'")
  return config
