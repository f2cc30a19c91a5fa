"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017, section 3) in Flax Linen.

Token ids are int32 with 0 as padding. The decoder reads the targets shifted right by one, with id 0
as the start symbol, and predicts every target position at once. Packed rows hold several pairs:
`segment_ids` number the pairs 1, 2, ... (0 = padding) and `positions` restart at 0 for each pair;
attention never crosses a pair. With `config.decode` the decoder runs one position per call over a
key/value cache (see `Transformer.decode`).
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import kernels

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Architecture and run mode; defaults are the paper's base model."""

  vocab_size: int
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1  # P_drop: each sub-layer output and the embedding + position sums
  attention_dropout_rate: float = 0.0  # on attention weights (not in the paper)
  relu_dropout_rate: float = 0.0  # on the feed-forward hidden layer (not in the paper)
  share_embeddings: bool = True  # one table for source and target tokens
  tie_output_embedding: bool = True  # pre-softmax projection = target embedding, transposed
  positional_encoding: str = 'sinusoidal'  # or 'learned'
  max_positions: int = 512  # rows of the learned position table
  layer_norm: str = 'post'  # 'post': LayerNorm(x + Sublayer(x)); 'pre': x + Sublayer(LayerNorm(x))
  layer_norm_epsilon: float = 1e-6
  # Marian's variants (transformer/marian.py), for models trained elsewhere: 'relu' (the paper's),
  # 'swish' (x * sigmoid(x), OPUS-MT's) or 'gelu' in the feed-forward layer; biases on the
  # attention projections; a bias on the logits; embeddings not scaled by sqrt(d_model).
  activation: str = 'relu'
  attention_bias: bool = False
  output_bias: bool = False
  scale_embedding: bool = True
  # How it computes, not what (transformer/kernels/README.md): 'xla', 'cudnn' or 'pallas' attention;
  # 'heads' (DenseGeneral's) or 'matrix' products for the attention's projections.
  attention_implementation: str = 'xla'
  attention_projection: str = 'heads'
  dtype: Any = jnp.float32  # computation
  param_dtype: Any = jnp.float32  # storage
  output_projection_dtype: Any = None  # the decoder output's for the output projection; None: dtype
  deterministic: bool = True  # False: apply dropout (needs a 'dropout' rng)
  decode: bool = False  # one target position per call, with a cache

  def replace(self, **changes) -> 'TransformerConfig':
    return dataclasses.replace(self, **changes)


def sinusoidal_encoding(positions: Array, d_model: int) -> Array:
  """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same); shape [..., d_model]."""
  inv_freq = 1.0 / (10000.0 ** (np.arange(0, d_model, 2) / d_model))
  angles = positions[..., None].astype(jnp.float32) * inv_freq
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*angles.shape[:-1], d_model)


def shift_right(targets: Array, segment_ids: Array | None = None) -> Array:
  """Decoder inputs: targets moved one step right, each pair starting from the start symbol 0."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  if segment_ids is not None:
    shifted = shifted * (segment_ids == jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1])
  return shifted


def attention_mask(query_tokens, key_tokens, query_segments=None, key_segments=None, causal=False):
  """[batch, 1, queries, keys] mask: both ends real tokens, same packed pair, no look-ahead."""
  masks = [nn.make_attention_mask(query_tokens > 0, key_tokens > 0)]
  if query_segments is not None:
    masks.append(nn.make_attention_mask(query_segments, key_segments, jnp.equal))
  if causal:
    masks.append(nn.make_causal_mask(query_tokens))
  return nn.combine_masks(*masks)


_dense_init = nn.initializers.xavier_uniform


def dot_product_attention(query: Array, key: Array, value: Array, mask: Array, dtype,
                          dropout_rng: Array | None = None, dropout_rate: float = 0.0,
                          cache_layout: bool = False, module: nn.Module | None = None) -> Array:
  """softmax(Q K^T / sqrt(d_k)) V (section 3.2.1) per head, the softmax in float32: the plain
  form, which every path takes unless a fused kernel replaces it (kernels/attention.py).

  Args:
    query: [batch, queries, heads, depth].
    key, value: [batch, keys, heads, depth]; with `cache_layout`, key [batch, heads, depth, keys]
      and value [batch, heads, keys, depth]: a decoding cache, read as it lies (in the other
      layout it would be transposed at every step).
    mask: broadcastable to [batch, heads, queries, keys]; True where a query may attend.
    dtype: the weights' dtype when they multiply the values (the model's).
    dropout_rng, dropout_rate: dropout on the weights, one mask for all rows and heads (flax's).
    module: sows the weights as intermediates' `attention_weights` (transformer/plots.py).

  Returns:
    [batch, queries, heads, depth].
  """
  key_axes, value_axes = ('bhdk', 'bhkd') if cache_layout else ('bkhd', 'bkhd')
  query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
  scores = jnp.einsum(f'bqhd,{key_axes}->bhqk', query, key).astype(jnp.float32)
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores).astype(dtype)
  if module is not None:
    module.sow('intermediates', 'attention_weights', weights)
  if dropout_rng is not None and dropout_rate > 0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, (1, 1, *weights.shape[-2:]))
    weights = weights * (keep.astype(dtype) / jnp.asarray(1.0 - dropout_rate, dtype))
  return jnp.einsum(f'bhqk,{value_axes}->bqhd', weights, value)


class MultiHeadAttention(nn.Module):
  """Multi-head scaled dot-product attention (section 3.2) with a decoding cache.

  Written around `dot_product_attention` because flax's MultiHeadDotProductAttention re-projects
  the whole encoder output at every decoding step; here cross-attention keys and values are
  projected once per sentence and cached, so that a decoding step costs one position. The caches
  hold keys as [batch, heads, depth, length] and values as [batch, heads, length, depth].

  Attributes:
    config: the architecture (d_model, num_heads, dtypes, attention_implementation, decode).
    cross: keys and values from the encoder output instead of the queries.
  """

  config: TransformerConfig
  cross: bool = False

  @nn.compact
  def __call__(self, x: Array, memory: Array | None, mask: Array, decode_index=None) -> Array:
    """Attention of the queries `x` over themselves, or over `memory` if `cross`.

    Args:
      x: [batch, length, d_model] queries (and keys and values, for self-attention).
      memory: [batch, memory_length, d_model] encoder output for cross-attention, else None.
      mask: [batch, 1, length, key_length] True where a query may attend; None while decoding
        self-attention (the unwritten part of the cache is masked here).
      decode_index: the position being decoded, with config.decode; None otherwise.

    Returns:
      [batch, length, d_model] in config.dtype.
    """
    cfg = self.config
    dense = functools.partial(
        nn.DenseGeneral, use_bias=cfg.attention_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        kernel_init=_dense_init(), dot_general=kernels.projection_product(cfg))
    output = dense(cfg.d_model, axis=(-2, -1), name='out')
    keys_from = memory if self.cross else x
    if kernels.applies(cfg, x.shape[1], keys_from.shape[1]):
      # A fused kernel (transformer/kernels): the same attention in fewer passes over memory.
      weights = {name: kernels.ProjectionWeights(cfg, name=name)()
                 for name in ('query', 'key', 'value')}
      return output(kernels.fused_attention(cfg, x, memory if self.cross else None, weights,
                                            mask))

    heads = (cfg.num_heads, cfg.d_model // cfg.num_heads)
    query = dense(heads, name='query')(x)
    project_keys = lambda inputs: (dense(heads, name='key')(inputs),
                                   dense(heads, name='value')(inputs))
    to_cache = lambda key, value: (key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3))
    attend = functools.partial(dot_product_attention, dtype=cfg.dtype)
    if cfg.decode and self.cross:
      if self.has_variable('cache', 'cached_key'):  # a step: keys and values projected before
        return output(attend(query, self.get_variable('cache', 'cached_key'),
                             self.get_variable('cache', 'cached_value'), mask, cache_layout=True))
      # Cache set-up: the encoder output is projected once per sentence.
      key, value = project_keys(memory)
      cached_key, cached_value = to_cache(key, value)
      self.put_variable('cache', 'cached_key', cached_key)
      self.put_variable('cache', 'cached_value', cached_value)
    elif cfg.decode:
      key, value = project_keys(x)
      batch, length, num_heads, depth = key.shape
      cached_key = self.variable('cache', 'cached_key', jnp.zeros,
                                 (batch, num_heads, depth, length), key.dtype)
      cached_value = self.variable('cache', 'cached_value', jnp.zeros,
                                   (batch, num_heads, length, depth), value.dtype)
      if decode_index is not None:  # a step: write this position, attend to the prefix
        key, value = to_cache(key, value)
        cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key,
                                                        (0, 0, 0, decode_index))
        cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, value,
                                                          (0, 0, decode_index, 0))
        prefix = (jnp.arange(cached_key.value.shape[-1]) <= decode_index)[None, None, None, :]
        return output(attend(query, cached_key.value, cached_value.value, prefix,
                             cache_layout=True))
    else:
      key, value = project_keys(keys_from)

    dropout_rng = None
    if not cfg.deterministic and cfg.attention_dropout_rate > 0:
      dropout_rng = self.make_rng('dropout')
    return output(attend(query, key, value, mask, dropout_rng=dropout_rng,
                         dropout_rate=cfg.attention_dropout_rate, module=self))


class Dropout(nn.Module):
  """nn.Dropout(rate) without broadcast dimensions: the same output and gradients for the same
  'dropout' rng, and with a hash_rng key (config.implementation.dropout_rng='hash') the mask
  drawn again in the backward pass. Named as flax's: flax folds a module's name (Dropout_0, ...)
  into its rng, so the name chooses the masks a run draws."""

  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    key = self.make_rng('dropout')
    if kernels.is_hash_key(key):  # transformer/kernels: the mask drawn again, not kept
      return kernels.dropout(x, key, self.rate)
    keep = jax.random.bernoulli(key, 1.0 - self.rate, x.shape)
    return jax.lax.select(keep, x / (1.0 - self.rate), jnp.zeros_like(x))


# Marian's other feed-forward activations (`TransformerConfig.activation`).
MARIAN_ACTIVATIONS = {'swish': jax.nn.silu, 'gelu': functools.partial(jax.nn.gelu,
                                                                      approximate=False)}


class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2 (section 3.3), or another `config.activation`."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dense = functools.partial(
        nn.Dense, dtype=cfg.dtype, param_dtype=cfg.param_dtype, kernel_init=_dense_init())
    h = dense(cfg.d_ff, name='hidden')(x)
    # kernels.relu computes jax.nn.relu's values.
    h = kernels.relu(h) if cfg.activation == 'relu' else MARIAN_ACTIVATIONS[cfg.activation](h)
    h = Dropout(cfg.relu_dropout_rate)(h, deterministic=cfg.deterministic)
    return dense(cfg.d_model, name='output')(h)


class SublayerConnection(nn.Module):
  """A sub-layer wrapped as section 5.4 has it, LayerNorm(x + Dropout(Sublayer(x))) (post-norm),
  or x + Dropout(Sublayer(LayerNorm(x))) (pre-norm)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, sublayer) -> Array:
    cfg = self.config
    norm = functools.partial(nn.LayerNorm, epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype, name='norm')
    drop = lambda y: Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    if cfg.layer_norm == 'pre':
      return x + drop(sublayer(norm()(x)))
    return norm()(x + drop(sublayer(x)))


class EncoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array) -> Array:
    cfg = self.config
    attention = MultiHeadAttention(cfg, name='self_attention')
    x = SublayerConnection(cfg, name='self_attention_residual')(
        x, lambda y: attention(y, None, mask))
    return SublayerConnection(cfg, name='feed_forward_residual')(
        x, FeedForward(cfg, name='feed_forward'))


class DecoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, encoded, self_mask, cross_mask, decode_index=None) -> Array:
    cfg = self.config
    self_attention = MultiHeadAttention(cfg, name='self_attention')
    cross_attention = MultiHeadAttention(cfg, cross=True, name='cross_attention')
    x = SublayerConnection(cfg, name='self_attention_residual')(
        x, lambda y: self_attention(y, None, self_mask, decode_index))
    x = SublayerConnection(cfg, name='cross_attention_residual')(
        x, lambda y: cross_attention(y, encoded, cross_mask))
    return SublayerConnection(cfg, name='feed_forward_residual')(
        x, FeedForward(cfg, name='feed_forward'))


class Embedder(nn.Module):
  """Token embedding times sqrt(d_model) (unless not `scale_embedding`), plus positional
  encoding, then dropout (section 3.4-3.5)."""

  config: TransformerConfig
  token_embedding: nn.Embed

  @nn.compact
  def __call__(self, tokens: Array, positions: Array) -> Array:
    cfg = self.config
    x = self.token_embedding(tokens).astype(cfg.dtype)
    if cfg.scale_embedding:
      x = x * jnp.sqrt(cfg.d_model).astype(cfg.dtype)
    if cfg.positional_encoding == 'learned':
      table = self.param('position_embedding', nn.initializers.normal(cfg.d_model**-0.5),
                         (cfg.max_positions, cfg.d_model), cfg.param_dtype)
      x = x + jnp.take(table, positions, axis=0).astype(cfg.dtype)
    else:
      x = x + sinusoidal_encoding(positions, cfg.d_model).astype(cfg.dtype)
    return Dropout(cfg.dropout_rate)(x, deterministic=cfg.deterministic)


def _final_norm(cfg: TransformerConfig, x: Array) -> Array:
  """Pre-norm stacks end with a LayerNorm; post-norm layers already end with one."""
  if cfg.layer_norm != 'pre':
    return x
  return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype,
                      param_dtype=cfg.param_dtype, name='final_norm')(x)


_default_positions = lambda tokens: jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)


class Encoder(nn.Module):
  """The encoder stack (section 3.1): embedding, then num_encoder_layers self-attention layers,
  reading its tokens from `token_embedding` (the table shared with the decoder, by default)."""

  config: TransformerConfig
  token_embedding: nn.Embed

  @nn.compact
  def __call__(self, sources, positions=None, segment_ids=None) -> Array:
    """The encoder's output [batch, length, d_model], in config.dtype.

    Args:
      sources: [batch, length] token ids, 0 = padding.
      positions: [batch, length] positions (packed rows restart at 0 per pair); default 0, 1, ...
      segment_ids: [batch, length] pair of each token in a packed row (1, 2, ...; 0 = padding);
        tokens attend only within their pair. None: one pair per row.
    """
    cfg = self.config
    if positions is None:
      positions = _default_positions(sources)
    mask = attention_mask(sources, sources, segment_ids, segment_ids)
    x = Embedder(cfg, self.token_embedding, name='embedder')(sources, positions)
    for i in range(cfg.num_encoder_layers):
      x = EncoderLayer(cfg, name=f'layer_{i}')(x, mask)
    return _final_norm(cfg, x)


class Decoder(nn.Module):
  """The decoder stack (section 3.1): embedding of the right-shifted targets, then
  num_decoder_layers of causal self-attention, cross-attention and feed-forward; with
  config.decode, one position per call over a cache."""

  config: TransformerConfig
  token_embedding: nn.Embed

  @nn.compact
  def __call__(self, encoded, sources, targets, target_positions=None, source_segment_ids=None,
               target_segment_ids=None) -> Array:
    """The decoder's output before the output projection.

    Args:
      encoded: [batch, source_length, d_model] encoder output.
      sources: [batch, source_length] source ids (their padding masks cross-attention).
      targets: [batch, length] target ids, shifted right here (teacher forcing); while decoding,
        the previous step's token [batch, 1].
      target_positions, source_segment_ids, target_segment_ids: of packed rows, as in `Encoder`.

    Returns:
      [batch, length, d_model] states in config.output_projection_dtype (None: config.dtype).
    """
    cfg = self.config
    decode_index = None
    if cfg.decode and self.has_variable('cache', 'index'):
      # One step: `targets` is [batch, 1], the token chosen at the previous step (0 at the first).
      index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
      decode_index = index.value
      index.value = decode_index + 1
      inputs = targets
      positions = jnp.full(targets.shape, decode_index)
      self_mask = None  # each self-attention layer masks the unwritten part of its cache
      cross_mask = attention_mask(jnp.ones_like(targets), sources)
    else:
      if cfg.decode:  # cache set-up: `targets` is a [batch, max_length] placeholder
        self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
      inputs = shift_right(targets, target_segment_ids)
      positions = _default_positions(targets) if target_positions is None else target_positions
      self_mask = attention_mask(targets, targets, target_segment_ids, target_segment_ids,
                                 causal=True)
      cross_mask = attention_mask(targets, sources, target_segment_ids, source_segment_ids)
    y = Embedder(cfg, self.token_embedding, name='embedder')(inputs, positions)
    for i in range(cfg.num_decoder_layers):
      y = DecoderLayer(cfg, name=f'layer_{i}')(y, encoded, self_mask, cross_mask, decode_index)
    return _final_norm(cfg, y).astype(cfg.output_projection_dtype or cfg.dtype)


class Transformer(nn.Module):
  """Encoder-decoder; `__call__(sources, targets)` gives float32 logits [batch, target_len, vocab].

  Parameters: `source_embedding` (the shared table unless `share_embeddings=False`, which adds
  `target_embedding`), `encoder`, `decoder`, `output_projection` only when
  `tie_output_embedding=False`, and `output_bias` [vocab] only with `config.output_bias`.
  """

  config: TransformerConfig

  def setup(self):
    cfg = self.config
    # Rows are looked up in the tables' own dtype and cast after (Embedder): the lookup's gradient,
    # a scatter-add of every token's row, then sums in float32: in bfloat16 it would round at each
    # of thousands of additions per frequent token, and GPUs add bfloat16 this way slowly.
    embed = functools.partial(
        nn.Embed, cfg.vocab_size, cfg.d_model, dtype=cfg.param_dtype, param_dtype=cfg.param_dtype)
    token_init = nn.initializers.normal(stddev=cfg.d_model**-0.5)
    self.source_embedding = embed(embedding_init=token_init)
    target_embedding = self.source_embedding
    if not cfg.share_embeddings:
      self.target_embedding = target_embedding = embed(embedding_init=token_init)
    self.encoder = Encoder(cfg, self.source_embedding)
    self.decoder = Decoder(cfg, target_embedding)
    # Logits are float32 whatever cfg.dtype (`project`): bfloat16 logits would round the loss and
    # the beam scores (8 bits of mantissa).
    output = target_embedding
    if not cfg.tie_output_embedding:  # a [vocab, d_model] table of its own
      output = self.output_projection = embed(embedding_init=_dense_init())
    bias = None
    if cfg.output_bias:
      bias = self.param('output_bias', nn.initializers.zeros, (cfg.vocab_size,), cfg.param_dtype)
    self.project_output = lambda y: project(y, output.embedding, bias)

  def encode(self, sources, source_positions=None, source_segment_ids=None) -> Array:
    """The encoder's output [batch, length, d_model]; arguments as in `Encoder`."""
    return self.encoder(sources, source_positions, source_segment_ids)

  def decode(self, encoded, sources, targets, target_positions=None, source_segment_ids=None,
             target_segment_ids=None) -> Array:
    """Float32 logits [batch, length, vocab] for `targets`; arguments as in `Decoder`. With
    `config.decode`, call once with `mutable=['cache']` and `targets` a [batch, max_length]
    placeholder (the cache's set-up), then once per step with the previous token [batch, 1]."""
    y = self.decoder(encoded, sources, targets, target_positions, source_segment_ids,
                     target_segment_ids)
    return self.project_output(y)

  def __call__(self, sources, targets, source_positions=None, source_segment_ids=None,
               target_positions=None, target_segment_ids=None, project: bool = True) -> Array:
    """A teacher-forced pass over a batch of pairs.

    Args:
      sources: [batch, source_length] source ids, 0 = padding.
      targets: [batch, target_length] target ids ending in EOS, 0 = padding.
      source_positions, source_segment_ids, target_positions, target_segment_ids: of packed
        rows (several pairs per row), as in `Encoder`; None for one pair per row.
      project: False gives the decoder's output instead of logits, for a loss that projects it
        itself (`kernels.loss.projected_token_sums` with `output_table`).

    Returns:
      float32 logits [batch, target_length, vocab] (with `project=False` the decoder's output).
    """
    encoded = self.encode(sources, source_positions, source_segment_ids)
    if project:
      return self.decode(encoded, sources, targets, target_positions, source_segment_ids,
                         target_segment_ids)
    return self.decoder(encoded, sources, targets, target_positions, source_segment_ids,
                        target_segment_ids)


def project(states: Array, table: Array, bias: Array | None = None) -> Array:
  """Float32 logits of `states` [..., d_model] against an output table [vocab, d_model], plus
  `bias` [vocab] if given."""
  if states.dtype == jnp.float32:
    logits = jnp.dot(states, table.astype(jnp.float32).T)
  else:  # not rounded to bfloat16 (8 bits of mantissa): the loss and the beam scores read them
    logits = kernels.low_precision_logits(states, table)
  return logits if bias is None else logits + bias.astype(jnp.float32)


def output_table(params) -> Array:
  """The pre-softmax projection as a [vocab, d_model] table: logits = output . table^T."""
  if 'output_projection' in params:
    return params['output_projection']['embedding']
  return params.get('target_embedding', params['source_embedding'])['embedding']

