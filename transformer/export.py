"""A trained run as a Hugging Face Marian directory (`MarianMTModel`, `MarianTokenizer`,
`pipeline('translation')`) or a CTranslate2 model directory, written from NumPy: exporting needs
neither PyTorch nor transformers (CTranslate2's own format needs the ctranslate2 package).

Both hold the model in Marian's layout (`transformer.marian`). What the other side then computes
differently, measured in tests/test_marian.py and docs/interop.md:
- transformers runs Marian's LayerNorms with epsilon 1e-5 whatever the run trained with;
  CTranslate2 takes the run's.
- Both divide a beam hypothesis's log-probability by length^alpha, where ours divides by GNMT's
  ((5 + length) / 6)^alpha; with alpha 0 all three rank hypotheses alike.
- Both limit outputs by one length for the whole batch (generation_config.json's max_length;
  CTranslate2's max_decoding_length), where ours allows each sentence its source length +
  decode_extra_length.
"""

import json
import os

import jax
import ml_collections
import numpy as np
from flax.traverse_util import flatten_dict

from transformer import marian
from transformer.config import model_config
from transformer.data.vocabulary import Vocabulary
from transformer.model import Transformer, sinusoidal_encoding

FORMATS = ('transformers', 'ctranslate2')
QUANTIZATIONS = ('float32', 'int8', 'int8_float32', 'int16')
MAX_POSITIONS = 512  # OPUS-MT's position table, and MarianTokenizer's default model_max_length


def max_positions(config: ml_collections.ConfigDict) -> int:
  """Positions the exported model encodes: the longest input or output a run translates."""
  return max(MAX_POSITIONS, config.max_length + config.decode_extra_length + 1)


def marian_tensors(params, config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """The run's parameters as Marian's float32 tensors by name (`marian.to_marian`)."""
  model = dict(config.model)
  marian.check_exportable(model)
  full = model_config(config).replace(attention_bias=True, output_bias=True)
  tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
  shapes = flatten_dict(jax.eval_shape(Transformer(full).init, jax.random.key(0), tokens,
                                       tokens)['params'])
  return marian.to_marian(flatten_dict(jax.device_get(params)), model, shapes)


def _json(value) -> str:
  return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + '\n'


def transformers_files(params, config: ml_collections.ConfigDict,
                       vocab: Vocabulary) -> dict[str, bytes]:
  """The files of a Hugging Face Marian directory, by name, but for the model card."""
  from safetensors.numpy import save  # pylint: disable=import-outside-toplevel

  model = dict(config.model)
  generation = {
      'bad_words_ids': [[0]],  # never pad, as our search
      'decoder_start_token_id': 0,
      'eos_token_id': 1,
      'forced_eos_token_id': 1,  # EOS at max_length, as our search at its limit
      'pad_token_id': 0,
      'num_beams': config.beam_size,
      # The decoder's start symbol counts in max_length.
      'max_length': config.max_length + config.decode_extra_length + 1,
      'length_penalty': config.alpha,  # length^alpha there, GNMT's penalty here
  }
  tokenizer = {
      'tokenizer_class': 'MarianTokenizer',
      'source_lang': config.source_lang,
      'target_lang': config.target_lang,
      'separate_vocabs': False,
      'model_max_length': MAX_POSITIONS,
      'pad_token': marian.PAD,
      'eos_token': marian.EOS,
      'unk_token': marian.UNK,
  }
  pieces = vocab.pieces(range(vocab.vocab_size))
  return {
      'config.json': _json(marian.hf_config(model, vocab.vocab_size, max_positions(config))),
      'generation_config.json': _json(generation),
      'model.safetensors': save(marian_tensors(params, config), metadata={'format': 'pt'}),
      'source.spm': vocab.sentencepiece_models()[0],
      'target.spm': vocab.sentencepiece_models()[1],
      'vocab.json': _json({piece: i for i, piece in enumerate(pieces)}),
      'tokenizer_config.json': _json(tokenizer),
  }


def ctranslate2_model(params, config: ml_collections.ConfigDict, vocab: Vocabulary):
  """A CTranslate2 `TransformerSpec` of the run, built from NumPy; `.optimize(quantization)` and
  `.save(directory)` write it."""
  from ctranslate2 import specs  # pylint: disable=import-outside-toplevel

  tensors = marian_tensors(params, config)
  model = config.model
  spec = specs.TransformerSpec.from_config(
      (model.num_encoder_layers, model.num_decoder_layers), model.num_heads, pre_norm=False,
      activation={'relu': specs.Activation.RELU, 'swish': specs.Activation.SWISH,
                  'gelu': specs.Activation.GELU}[model.activation])
  positions = np.asarray(sinusoidal_encoding(np.arange(max_positions(config)), model.d_model))
  positions = positions[:, marian.residual_order(model.d_model)]  # Marian's layout, as the rest

  def linear(layer_spec, *names):
    layer_spec.weight = np.concatenate([tensors[f'{name}.weight'] for name in names])
    layer_spec.bias = np.concatenate([tensors[f'{name}.bias'] for name in names])

  def norm(layer_spec, name):
    layer_spec.gamma, layer_spec.beta = tensors[f'{name}.weight'], tensors[f'{name}.bias']

  def attention(layer_spec, name, cross=False):
    projections = [f'{name}.{p}_proj' for p in 'qkv']
    if cross:
      linear(layer_spec.linear[0], projections[0])
      linear(layer_spec.linear[1], *projections[1:])
    else:
      linear(layer_spec.linear[0], *projections)
    linear(layer_spec.linear[-1], f'{name}.out_proj')

  embedding = {'encoder': 'model.encoder.embed_tokens.weight',
               'decoder': 'model.decoder.embed_tokens.weight'}
  for side, side_spec in (('encoder', spec.encoder), ('decoder', spec.decoder)):
    table = tensors.get(embedding[side], tensors.get('model.shared.weight'))
    (side_spec.embeddings[0] if side == 'encoder' else side_spec.embeddings).weight = table
    side_spec.scale_embeddings = bool(model.scale_embedding)
    side_spec.position_encodings.encodings = positions
    for i, layer_spec in enumerate(side_spec.layer):
      prefix = f'model.{side}.layers.{i}'
      attention(layer_spec.self_attention, f'{prefix}.self_attn')
      norm(layer_spec.self_attention.layer_norm, f'{prefix}.self_attn_layer_norm')
      if side == 'decoder':
        attention(layer_spec.attention, f'{prefix}.encoder_attn', cross=True)
        norm(layer_spec.attention.layer_norm, f'{prefix}.encoder_attn_layer_norm')
      linear(layer_spec.ffn.linear_0, f'{prefix}.fc1')
      linear(layer_spec.ffn.linear_1, f'{prefix}.fc2')
      norm(layer_spec.ffn.layer_norm, f'{prefix}.final_layer_norm')
  output = tensors.get('lm_head.weight', tensors.get(
      'model.decoder.embed_tokens.weight', tensors.get('model.shared.weight')))
  spec.decoder.projection.weight = output
  if model.output_bias:
    spec.decoder.projection.bias = tensors['final_logits_bias'][0]

  pieces = vocab.pieces(range(vocab.vocab_size))
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  spec.config.unk_token, spec.config.eos_token = marian.UNK, marian.EOS
  spec.config.bos_token = spec.config.decoder_start_token = marian.PAD
  spec.config.layer_norm_epsilon = float(model.layer_norm_epsilon)
  spec.validate()
  return spec


def write(params, config: ml_collections.ConfigDict, vocab: Vocabulary, directory: str,
          format_name: str = 'transformers', quantization: str = 'float32'):
  """The run's `params` as `format_name` (FORMATS; ctranslate2 at `quantization`) in the existing
  `directory`, with the vocabulary's SentencePiece models, but for the model card."""
  if format_name == 'transformers':
    files = transformers_files(params, config, vocab)
  else:
    spec = ctranslate2_model(params, config, vocab)
    spec.optimize(quantization=None if quantization == 'float32' else quantization)
    spec.save(directory)
    files = dict(zip(('source.spm', 'target.spm'), vocab.sentencepiece_models()))
  for name, content in files.items():
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(content if isinstance(content, bytes) else content.encode('utf-8'))
