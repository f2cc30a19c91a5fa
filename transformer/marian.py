"""Our model in Hugging Face's Marian layout (`MarianMTModel`, as the OPUS-MT models are
published) and back: its config.json, its weights by name, and its token ids.

The two architectures are the same post-norm Transformer up to details handled here exactly:
- Position encodings: ours interleave sin and cos (PE(pos, 2i), PE(pos, 2i+1)); Marian's hold
  every sine in the first half of d_model and every cosine in the second. Marian's residual
  stream is ours with its d_model features reordered by `residual_order`, so every weight that
  reads or writes it (embeddings, the projections into and out of attention and feed-forward
  layers, LayerNorms) is reordered the same way; per-head and feed-forward hidden features keep
  their order. The model then computes the same, up to float rounding (tests/test_marian.py).
- Marian's attention projections and logits have biases: exported as zeros where ours has none;
  imported as the model's `attention_bias` and `output_bias`.
- LayerNorm epsilon: transformers' Marian hard-codes 1e-5 (torch's default) and its config.json
  has no field for it; ours is a config key (1e-6 in configs/default.py). An exported model runs
  there with 1e-5; an imported one runs here with 1e-5, as it ran there.
- Token ids: ours have pad 0 (also the decoder's start symbol), EOS 1, unk 2, which an export
  keeps. OPUS-MT's have EOS 0, unk 1 and pad (the start symbol) last: `token_order` gives our
  order of a Marian vocabulary's ids.
"""

import json
import os

import jax
import ml_collections
import numpy as np
import yaml
from etils import epath
from flax.traverse_util import flatten_dict, unflatten_dict

from transformer import config as config_lib
from transformer.model import Transformer, TransformerConfig

# transformers' modeling_marian builds its LayerNorms with torch's default epsilon.
LAYER_NORM_EPSILON = 1e-5
ACTIVATIONS = {'relu': 'relu', 'swish': 'swish', 'silu': 'swish', 'gelu': 'gelu'}  # theirs: ours
PAD, EOS, UNK = '<pad>', '</s>', '<unk>'  # the pieces of the special ids, in both vocabularies
# Model keys an import leaves to the experiment's config: how to fine-tune, not what the model is.
TRAINING_KEYS = ('dropout_rate', 'attention_dropout_rate', 'relu_dropout_rate')


class MarianError(ValueError):
  """A model that one side cannot express; the message names the option or field."""


def residual_order(d_model: int) -> np.ndarray:
  """Marian's residual features as ours: feature i there is feature order[i] here (all even
  features, the sines, then all odd ones, the cosines)."""
  return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def check_exportable(model: dict):
  """Raises MarianError naming the first key of `model` (a config.model dict) Marian lacks."""
  unsupported = {
      'layer_norm': ('post', "Marian's layers are post-norm, LayerNorm(x + Sublayer(x)), with no "
                             'final LayerNorm'),
      'positional_encoding': ('sinusoidal', 'Marian adds fixed sinusoidal positions, which it '
                                            'does not store; it has no learned table'),
  }
  for key, (needed, why) in unsupported.items():
    if model[key] != needed:
      raise MarianError(f'config.model.{key}={model[key]!r}: {why}; only a run trained with '
                        f'{needed!r} can be exported')


def hf_config(model: dict, vocab_size: int, max_positions: int) -> dict:
  """The config.json of a MarianMTModel for `model` (a config.model dict) with our token ids."""
  check_exportable(model)
  layers = {'encoder': model['num_encoder_layers'], 'decoder': model['num_decoder_layers']}
  config = {
      'architectures': ['MarianMTModel'],
      'model_type': 'marian',
      'vocab_size': vocab_size,
      'decoder_vocab_size': vocab_size,
      'd_model': model['d_model'],
      'activation_function': model['activation'],
      'dropout': model['dropout_rate'],
      'attention_dropout': model['attention_dropout_rate'],
      'activation_dropout': model['relu_dropout_rate'],
      'scale_embedding': model['scale_embedding'],
      'share_encoder_decoder_embeddings': model['share_embeddings'],
      'tie_word_embeddings': model['tie_output_embedding'],
      'max_position_embeddings': max_positions,
      'pad_token_id': 0,
      'decoder_start_token_id': 0,
      'eos_token_id': 1,
      'forced_eos_token_id': 1,
      'is_encoder_decoder': True,
      'use_cache': True,
      'init_std': 0.02,
      'dtype': 'float32',
      'num_hidden_layers': layers['encoder'],
  }
  for side, count in layers.items():
    config.update({f'{side}_layers': count, f'{side}_ffn_dim': model['d_ff'],
                   f'{side}_attention_heads': model['num_heads'], f'{side}_layerdrop': 0.0})
  return dict(sorted(config.items()))


def model_keys(config: dict) -> dict:
  """Our config.model keys of a Marian config.json's dict.

  Raises:
    MarianError: a field our model cannot represent, named.
  """
  def field(name, default=None):
    if name not in config and default is None:
      raise MarianError(f'config.json has no "{name}": it is not a Marian config')
    return config.get(name, default)

  def same(encoder_field, decoder_field):
    value = field(encoder_field)
    if field(decoder_field) != value:
      raise MarianError(f'config.json: "{decoder_field}"={config[decoder_field]} differs from '
                        f'"{encoder_field}"={value}; this model has one value for both sides')
    return value

  if field('model_type', 'marian') != 'marian':
    raise MarianError(f'config.json: "model_type"={config["model_type"]!r}: only Marian models '
                      '(MarianMTModel) can be imported')
  activation = ACTIVATIONS.get(field('activation_function', 'gelu'))
  if activation is None:
    raise MarianError(f'config.json: "activation_function"={config["activation_function"]!r}: '
                      f'this model has {", ".join(sorted(set(ACTIVATIONS)))}')
  vocab_size = field('vocab_size')
  if field('decoder_vocab_size', vocab_size) != vocab_size:
    raise MarianError(f'config.json: "decoder_vocab_size"={config["decoder_vocab_size"]} differs '
                      f'from "vocab_size"={vocab_size}; this model has one vocabulary size')
  for name in ('encoder_layerdrop', 'decoder_layerdrop'):
    if field(name, 0.0) != 0.0:
      raise MarianError(f'config.json: "{name}"={config[name]}: this model has no LayerDrop; set '
                        'it to 0.0')
  d_model = field('d_model')
  num_heads = same('encoder_attention_heads', 'decoder_attention_heads')
  if d_model % 2 or d_model % num_heads:
    raise MarianError(f'config.json: "d_model"={d_model} must be even and divisible by the '
                      f'{num_heads} attention heads')
  return {
      'd_model': d_model,
      'd_ff': same('encoder_ffn_dim', 'decoder_ffn_dim'),
      'num_heads': num_heads,
      'num_encoder_layers': field('encoder_layers'),
      'num_decoder_layers': field('decoder_layers'),
      'dropout_rate': float(field('dropout', 0.1)),
      'attention_dropout_rate': float(field('attention_dropout', 0.0)),
      'relu_dropout_rate': float(field('activation_dropout', 0.0)),
      'share_embeddings': bool(field('share_encoder_decoder_embeddings', True)),
      'tie_output_embedding': bool(field('tie_word_embeddings', True)),
      'positional_encoding': 'sinusoidal',
      'layer_norm': 'post',
      'layer_norm_epsilon': LAYER_NORM_EPSILON,
      'activation': activation,
      'attention_bias': True,
      'output_bias': True,
      'scale_embedding': bool(field('scale_embedding', False)),
  }


def token_order(config: dict, vocab: dict) -> np.ndarray:
  """Our token ids of a Marian vocabulary: our id i is Marian's order[i] (pad, EOS and unk first,
  then the rest in Marian's order).

  Args:
    config: Marian's config.json.
    vocab: Marian's vocab.json, piece -> id.

  Raises:
    MarianError: the special ids are missing, clash, or the decoder does not start with pad.
  """
  size = config['vocab_size']
  pad, eos = config.get('pad_token_id'), config.get('eos_token_id')
  start = config.get('decoder_start_token_id', pad)
  if start != pad:
    raise MarianError(f'config.json: "decoder_start_token_id"={start} is not "pad_token_id"='
                      f'{pad}: this model starts decoding from its padding id')
  if UNK not in vocab:
    raise MarianError(f'vocab.json has no {UNK!r} piece')
  special = [pad, eos, vocab[UNK]]
  if len(set(special)) != 3 or not all(isinstance(i, int) and 0 <= i < size for i in special):
    raise MarianError(f'config.json: pad {pad}, EOS {eos} and unk {vocab[UNK]} ids must be '
                      f'three distinct ids below "vocab_size"={size}')
  rest = np.setdiff1d(np.arange(size), special)
  return np.concatenate([special, rest]).astype(np.int64)


def _module_names(side: str) -> dict:
  """Our layer's module names -> Marian's."""
  names = {'self_attention': 'self_attn', 'self_attention_residual': 'self_attn_layer_norm',
           'feed_forward_residual': 'final_layer_norm'}
  if side == 'decoder':
    names.update({'cross_attention': 'encoder_attn',
                  'cross_attention_residual': 'encoder_attn_layer_norm'})
  return names


def _marian_name(path: tuple, model: dict) -> tuple[str, str]:
  """(Marian's tensor name, how the array maps) of our parameter at `path`. The ways: 'table'
  ([vocab, d_model] rows in token order), 'logits_bias', 'in' (a kernel [d_model, ...] read from
  the residual stream), 'out' (a kernel [..., d_model] written to it), 'residual' (a [d_model]
  vector of it), 'plain' (features of a hidden layer or heads)."""
  if path[0] == 'source_embedding':
    return ('model.shared.weight' if model['share_embeddings'] else
            'model.encoder.embed_tokens.weight'), 'table'
  if path[0] == 'target_embedding':
    return 'model.decoder.embed_tokens.weight', 'table'
  if path[0] == 'output_projection':
    return 'lm_head.weight', 'table'
  if path[0] == 'output_bias':
    return 'final_logits_bias', 'logits_bias'
  side, layer, module, sub, param = path
  prefix = f'model.{side}.layers.{layer.removeprefix("layer_")}'
  if module == 'feed_forward':
    name, reads = {'hidden': ('fc1', True), 'output': ('fc2', False)}[sub]
  elif module.endswith('_residual'):
    return f'{prefix}.{_module_names(side)[module]}.{"weight" if param == "scale" else "bias"}', (
        'residual')
  else:
    projection = {'query': 'q_proj', 'key': 'k_proj', 'value': 'v_proj', 'out': 'out_proj'}[sub]
    name, reads = f'{_module_names(side)[module]}.{projection}', sub != 'out'
  if param == 'kernel':
    return f'{prefix}.{name}.weight', 'in' if reads else 'out'
  return f'{prefix}.{name}.bias', 'plain' if reads else 'residual'


def to_marian(params: dict, model: dict, shapes: dict) -> dict[str, np.ndarray]:
  """Marian's tensors (float32, torch's [out, in] layout) of our parameters.

  Args:
    params: our parameters, a flat dict path -> array (flax.traverse_util.flatten_dict).
    model: their config.model dict.
    shapes: the flat shapes of the same model with attention_bias and output_bias: the biases
      our model lacks are exported as zeros.
  """
  order = residual_order(model['d_model'])
  tensors = {}
  for path, shape in shapes.items():
    value = np.asarray(params[path], np.float32) if path in params else np.zeros(
        shape.shape, np.float32)
    name, way = _marian_name(path, model)
    if way == 'table':
      value = value[:, order]
    elif way == 'logits_bias':
      value = value[None, :]
    elif way == 'in':
      value = value.reshape(value.shape[0], -1)[order].T
    elif way == 'out':
      value = value.reshape(-1, value.shape[-1])[:, order].T
    elif way == 'residual':
      value = value[order]
    else:
      value = value.reshape(-1)
    tensors[name] = np.ascontiguousarray(value)
  return tensors


def from_marian(tensors: dict, model: dict, shapes: dict, tokens: np.ndarray) -> dict:
  """Our parameters (a flat dict path -> float32 array) of Marian's tensors; `to_marian`'s
  inverse, with token rows reordered by `tokens` (`token_order`).

  Raises:
    MarianError: a tensor missing or of another shape, named.
  """
  inverse = np.argsort(residual_order(model['d_model']))
  tied = {'model.encoder.embed_tokens.weight': 'model.shared.weight',
          'model.decoder.embed_tokens.weight': 'model.shared.weight'}
  params = {}
  for path, shape in shapes.items():
    name, way = _marian_name(path, model)
    if name not in tensors and tied.get(name) in tensors:
      name = tied[name]
    if name not in tensors:
      if way == 'logits_bias':  # transformers leaves it out of some saved models: zeros
        params[path] = np.zeros(shape.shape, np.float32)
        continue
      raise MarianError(f'the weights have no tensor {name!r}, which the config.json\'s model '
                        'needs')
    value = np.asarray(tensors[name], np.float32)
    if way == 'table':
      value = value[tokens][:, inverse]
    elif way == 'logits_bias':
      value = value.reshape(-1)[tokens]
    elif way == 'in':
      value = value.T[inverse]
    elif way == 'out':
      value = value.T[:, inverse]
    elif way == 'residual':
      value = value[inverse]
    if value.size != int(np.prod(shape.shape)):
      raise MarianError(f'tensor {name!r} has shape {list(tensors[name].shape)}, where the '
                        "config.json's model needs "
                        f'{int(np.prod(shape.shape))} values')
    params[path] = np.ascontiguousarray(value.reshape(shape.shape))
  return params


def read_json(directory: str, name: str) -> dict:
  """A JSON object of a Marian directory's file, or MarianError naming it."""
  path = os.path.join(directory, name)
  try:
    value = json.loads(epath.Path(path).read_bytes())
  except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
    raise MarianError(f'{path} not found: give a Hugging Face Marian directory (config.json, '
                      'model.safetensors, source.spm, target.spm, vocab.json)') from None
  except ValueError as error:
    raise MarianError(f'{path} is not JSON ({error})') from None
  if not isinstance(value, dict):
    raise MarianError(f'{path} holds a JSON {type(value).__name__}, not an object')
  return value


def check_directory(directory: str) -> dict:
  """A Marian directory's config.json, once its weights and vocabulary files are known to be
  there.

  Raises:
    MarianError: a file is missing or not JSON, or a field this model cannot represent; named.
  """
  config = read_json(directory, 'config.json')
  model_keys(config)
  token_order(config, read_json(directory, 'vocab.json'))
  weights_path(directory)
  return config


def weights_path(directory: str) -> str:
  """The model.safetensors of a Marian directory."""
  path = os.path.join(directory, 'model.safetensors')
  if not os.path.exists(path):
    other = [name for name in ('pytorch_model.bin', 'tf_model.h5', 'flax_model.msgpack')
             if os.path.exists(os.path.join(directory, name))]
    fix = (f'it has {other[0]}: write model.safetensors with transformers, '
           '`MarianMTModel.from_pretrained(DIR).save_pretrained(NEW_DIR)`' if other else
           'give a Hugging Face Marian directory')
    raise MarianError(f'{path} not found; {fix}')
  return path


def read_tensors(directory: str) -> dict[str, np.ndarray]:
  """model.safetensors of a Marian directory, as NumPy arrays by name."""
  from safetensors import SafetensorError  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

  path = weights_path(directory)
  try:
    return load_file(path)
  except (SafetensorError, OSError, ValueError) as error:
    raise MarianError(f'{path} cannot be read ({error})') from None


def with_imported_model(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` (changed in place) with the architecture and vocab_size of config.init_from's
  Marian model, if set; its dropout rates stay the config's.

  Raises:
    config_lib.ConfigError: config.init_from is not a Marian directory this model can represent;
      the message names the file or field.
  """
  if not config.init_from:
    return config
  try:
    imported = check_directory(config.init_from)
    keys = model_keys(imported)
  except MarianError as error:
    raise config_lib.ConfigError(f'config.init_from={config.init_from!r}: {error}') from None
  config.model.update({key: value for key, value in keys.items() if key not in TRAINING_KEYS})
  config.vocab_size = imported['vocab_size']
  return config


def import_params(directory: str, model: TransformerConfig) -> dict:
  """The parameters of the Marian model in `directory` for our `model` (its config's
  `model_keys`), token rows in our order (`token_order` of its config.json and vocab.json)."""
  tokens = token_order(read_json(directory, 'config.json'), read_json(directory, 'vocab.json'))
  shapes = flatten_dict(jax.eval_shape(
      Transformer(model).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 1), np.int32),
      jax.ShapeDtypeStruct((1, 1), np.int32))['params'])
  keys = {key: getattr(model, key) for key in ('d_model', 'share_embeddings')}
  return unflatten_dict(from_marian(read_tensors(directory), keys, shapes, tokens))


def is_marian_directory(path: str) -> bool:
  """Whether `path` holds a Hugging Face Marian model (its config.json's "model_type" is
  "marian") rather than a train.py workdir."""
  try:
    return json.loads(epath.Path(path, 'config.json').read_bytes()).get('model_type') == 'marian'
  except (OSError, ValueError, AttributeError):  # no such file, not JSON, not an object
    return False


def decoding_keys(directory: str) -> dict:
  """Our `beam_size` and `alpha` from the directory's "num_beams" and "length_penalty", where
  its generation_config.json (or, as older models keep them, its config.json) gives them."""
  keys = {}
  for name in ('config.json', 'generation_config.json'):  # the second wins
    if epath.Path(directory, name).exists():
      settings = read_json(directory, name)
      keys.update({ours: settings[theirs] for theirs, ours in (('num_beams', 'beam_size'),
                                                               ('length_penalty', 'alpha'))
                   if theirs in settings})
  return keys


def card_languages(directory: str) -> tuple[str, str] | None:
  """(source, target) language of the model card's front matter (README.md's `language:`, two
  codes, the source first, as export.py writes them), or None where it names no such pair."""
  path = epath.Path(directory, 'README.md')
  try:
    text = path.read_text(encoding='utf-8')
    front = yaml.safe_load(text.split('---')[1]) if text.startswith('---') else None
  except (OSError, ValueError, yaml.YAMLError):
    return None
  languages = front.get('language') if isinstance(front, dict) else None
  if isinstance(languages, list) and len(languages) == 2 and all(
      isinstance(code, str) for code in languages):
    return languages[0], languages[1]
  return None
