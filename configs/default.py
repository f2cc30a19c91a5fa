r"""Transformer base, WMT14 English->German: the paper's recipe (Vaswani et al. 2017, Table 3 'base').

  python prepare.py --config=configs/default.py  # once: dataset, vocabulary, token ids
  python train.py --config=configs/default.py --workdir=runs/base_ende

The paper: 27.3 BLEU on newstest2014 (`bleu_paper` in eval.py: tokenized, compound-split BLEU).
Not run here yet; the time a step takes on a GPU: docs/speed.md. Every number below is the
paper's unless its comment says otherwise.

Cloud TPU slices it was compiled for here, with libtpu and no TPU, and the share of a device's
memory its largest train program and beam search take (`python tpu_plan.py
--config=configs/default.py --topology=v5e:2x4`; all: benchmarks/results/tpu_plan.md):
  v5e-8: fits; train step 21%, beam search 40%
  v4-8: fits; train step 16%, beam search 21%
  v6e-8: fits; train step 10%, beam search 20%
  v5e-1: fits; train step 91%, beam search 42%
"""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()

  # Data: WMT 2014 English-German, 4.5M pairs; newstest2013 validation, newstest2014 test.
  config.dataset = 'wmt14_translate/de-en'  # a TFDS name, 'multi30k', 'text' or 'synthetic'
  config.source_lang = 'en'
  config.target_lang = 'de'
  # One model for several pairs, e.g. 'en-de,en-fr' (Johnson et al. 2017): each source starts with
  # a tag of its target language (<2de>, <2fr>), a piece of the shared vocabulary; training mixes
  # the pairs' data, evaluation scores each pair. source_lang and target_lang are then its first.
  # Empty: source_lang -> target_lang, untagged.
  config.pairs = ''
  # Tags that may start a source in the data besides those (comma-separated), each made one piece
  # of the vocabulary: e.g. '<BT>' marking back-translated pairs (Caswell et al. 2019,
  # docs/back_translation.md).
  config.source_tags = ''
  # Files fetched by hand: Multi30k's nine, or a TFDS dataset's downloads named as in their URLs
  # (prepare.py lists them when a download fails); empty = download.
  config.manual_dir = ''
  config.vocab_size = 37000  # shared source-target byte-pair vocabulary
  config.vocab_model_type = 'bpe'  # SentencePiece model type
  config.max_length = 256  # pairs with a side longer than this (in tokens) are dropped (t2t's)
  # Real (non-padding) tokens per side and update, as the paper counts its ~25000 + 25000; rows
  # per batch follow from each padded length's mean real tokens (transformer/data/batching.py).
  config.tokens_per_batch = 25000

  # Input pipeline (not from the paper).
  config.packing = False  # True: several pairs per max_length row instead of length buckets
  config.vocab_sample_size = 1_000_000  # training pairs (both sides) the vocabulary learns from
  # Where prepared data goes (TFDS datasets, vocabularies, token ids); empty = TFDS's default.
  config.tfds_data_dir = ''
  config.train_files = ''  # dataset='text': e.g. 'data/train.{lang}.gz', {lang} = a language
  config.validation_files = ''  # dataset='text', optional
  config.test_files = ''  # dataset='text', optional

  # Model (section 3, base): N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1.
  config.model = ml_collections.ConfigDict(dict(
      d_model=512,
      d_ff=2048,
      num_heads=8,
      num_encoder_layers=6,
      num_decoder_layers=6,
      dropout_rate=0.1,
      attention_dropout_rate=0.0,  # not used in the paper
      relu_dropout_rate=0.0,  # not used in the paper
      share_embeddings=True,  # section 3.4: one matrix for both embeddings and the softmax
      tie_output_embedding=True,
      positional_encoding='sinusoidal',
      max_positions=512,  # size of the table if positional_encoding='learned'
      layer_norm='post',  # LayerNorm(x + Sublayer(x))
      layer_norm_epsilon=1e-6,  # not stated in the paper; t2t's value
      # Marian's variants, which models imported from it use (transformer/marian.py): 'swish' or
      # 'gelu' for the paper's ReLU, biases on the attention projections and the logits, and
      # embeddings not scaled by sqrt(d_model).
      activation='relu',
      attention_bias=False,
      output_bias=False,
      scale_embedding=True,
      dtype='bfloat16',  # computation; the paper trained in float32 on P100 GPUs
      param_dtype='float32',
      # The decoder output's dtype for the output projection, its sums float32 either way;
      # '' = dtype's. flax's examples/wmt projects in float32.
      output_projection_dtype='',
  ))

  # Optimisation (section 5.3-5.4): Adam, lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).
  config.label_smoothing = 0.1
  config.schedule = 'paper'  # or 'warmup_rsqrt': the same shape from peak_learning_rate
  config.lr_scale = 1.0  # 'paper' only
  config.peak_learning_rate = 7e-4  # 'warmup_rsqrt' only; ~ the paper's peak for base
  config.cooldown_steps = 0  # > 0: the last this many steps decay linearly to 0 (not the paper's)
  config.warmup_steps = 4000
  config.adam_b1 = 0.9
  config.adam_b2 = 0.98
  config.adam_eps = 1e-9
  config.grad_clip_norm = 0.0  # 0 = no clipping
  config.num_train_steps = 100_000
  config.grad_accum_steps = 1  # raise to reach tokens_per_batch on fewer devices
  config.seed = 0
  # A Hugging Face Marian directory (an OPUS-MT model, or export.py's) to start from: its model,
  # vocabulary and weights replace config.model's architecture keys, vocab_size and the random
  # initialisation; training then fine-tunes it on the config's data.
  config.init_from = ''

  # Logging, evaluation and checkpoints (0 = never).
  config.log_every_steps = 100
  config.eval_every_steps = 1000
  config.bleu_every_steps = 10_000
  # Training ends with both BLEUs of the averaged checkpoints on these splits (comma-separated;
  # empty: none). An untrained model decodes every sentence to its length + decode_extra_length:
  # a quick check of a set-up (num_train_steps=3) leaves them out.
  config.final_bleu_splits = 'validation,test'
  # Section 6.1 wrote checkpoints at 10-minute intervals, on 8 P100s ~1,400 base steps (100k in
  # 12 hours): by steps, the averaged window is the paper's on any hardware.
  config.checkpoint_every_steps = 1400
  config.checkpoint_every_secs = 0
  config.keep_checkpoints = 5
  config.average_last = 5  # section 6.1: base models average the last 5 checkpoints
  # Several hosts agree on a SIGTERM (and a due timed checkpoint) every this many steps and at
  # each log, evaluation and checkpoint step, not every step: each agreement waits for the
  # device. One host checks every step.
  config.preemption_check_every_steps = 10

  # Decoding (section 6.1): beam 4, length penalty alpha 0.6, max output = input length + 50.
  config.beam_size = 4
  config.alpha = 0.6
  config.decode_extra_length = 50
  # Target languages whose paper BLEU splits compounds (##AT##), as get_ende_bleu.sh does for
  # German; comma-separated.
  config.compound_split_languages = 'de'

  # How it computes, not what (transformer/kernels/README.md): each choice gives the same results
  # at another speed; '' or 0 = the fastest this machine runs (transformer/kernels/choice.py).
  config.implementation = ml_collections.ConfigDict(dict(
      attention='',  # 'xla' (model.dot_product_attention), 'cudnn' or 'pallas'
      attention_projection='',  # 'heads' (DenseGeneral's product) or 'matrix'
      loss_chunk_tokens=0,  # target positions per chunk of the output projection and loss
      loss_reduction='',  # 'separate' passes over the logits, or 'online', one
      # Dropout's random bits (not in the paper): 'hash' (transformer/kernels/hash_rng.py) hashes
      # each element's index with the key, the same bits on every backend and cheaper than JAX's
      # generators ('rbg', 'unsafe_rbg', or its default 'threefry2x32').
      dropout_rng='hash',
      # Source tokens x beam_size per beam-search call and device (not from the paper). 0: the
      # training batch's share on a CPU, 2**17 on an accelerator.
      decode_batch_tokens=0,
  ))
  # Where compiled programs are kept for later runs and eval.py (empty = not kept), e.g.
  # ~/.cache/transformer-nmt/jax: a second run starts without compiling.
  config.compilation_cache_dir = ''
  # XLA flags for this run (space-separated '--xla_...=value'), added to the XLA_FLAGS environment
  # variable when a command starts; a flag XLA_FLAGS already names keeps its value. These are a
  # GPU's (a CPU's compiler runs none of them), each measured in docs/speed.md: cuBLAS for every
  # matmul instead of XLA's Triton matmuls; matmuls that share an input left apart (the dot merger
  # would join the attention's projections, which cuDNN's attention then copies apart); the
  # matmuls' weights sliced out of the packed parameters before the matmul, so that the step
  # stays one CUDA graph.
  config.xla_flags = ('--xla_gpu_enable_triton_gemm=false --xla_disable_hlo_passes=dot-merger '
                      '--xla_gpu_enable_dynamic_slice_fusion=false')
  return config
