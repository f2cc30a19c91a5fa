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

from transformer import fused_attention, fused_norm, hash_rng

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
  # 'xla'; 'cudnn': cuDNN's fused attention kernel (a GPU, bfloat16 or float16, no attention
  # dropout); 'pallas': one Pallas kernel each way for rows of up to 128 positions (longer ones
  # XLA's; transformer/fused_attention.py), over the projections of an input made in one product.
  # The decoding cache's one-position steps always run cached_attention.
  attention_implementation: str = 'xla'
  # 'heads': DenseGeneral's product over the head axes of the attention's projections;
  # 'matrix': one matrix product each, the same kernels (see _matrix_product).
  attention_projection: str = 'heads'
  # 'xla', or 'pallas': in training, each post-norm sub-layer's dropout, residual sum and layer
  # norm in one Pallas kernel each way (transformer/fused_norm.py; a GPU, d_model a power of 2).
  norm_implementation: str = 'xla'
  dtype: Any = jnp.float32  # computation
  param_dtype: Any = jnp.float32  # storage
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


def _dense_init():
  return nn.initializers.xavier_uniform()


def cached_attention(query: Array, keys: Array, values: Array, mask: Array) -> Array:
  """One decoding step's attention over a cache kept in the layout its matmuls read.

  query [batch, 1, heads, depth]; keys [batch, heads, depth, length] and values
  [batch, heads, length, depth]; mask broadcastable to [batch, heads, 1, length]. Computes what
  `nn.dot_product_attention` does (scaled query, float32 softmax, masked scores at the dtype's
  minimum); written out because a cache in that function's layout is transposed at every step.
  """
  depth = query.shape[-1]
  query = jnp.swapaxes(query / jnp.sqrt(depth).astype(query.dtype), 1, 2)  # [batch, heads, 1, d]
  scores = jnp.einsum('bhqd,bhdk->bhqk', query, keys).astype(jnp.float32)
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores).astype(values.dtype)
  return jnp.einsum('bhqk,bhkd->bqhd', weights, values)


def _matrix_product(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """DenseGeneral's dot_general, the last axes of `lhs` with the first of `rhs` (the kernel), as
  one [..., K] x [K, N] matrix product; the kernel keeps its shape. With the heads as separate
  axes, XLA's GPU matmuls computed the attention's weight gradients transposed, and the sums of
  their split-K parts transposed them back: 54 us per 512x512 weight at base size on an H100,
  against 4 us for feed-forward weights of as many bytes (docs/speed.md).
  """
  (_, kernel_axes), _ = dimension_numbers
  axes = len(kernel_axes)
  flat = lhs.reshape(*lhs.shape[:lhs.ndim - axes], -1)
  out = jax.lax.dot_general(flat, rhs.reshape(flat.shape[-1], -1),
                            (((flat.ndim - 1,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=preferred_element_type)
  return out.reshape(*flat.shape[:-1], *rhs.shape[axes:])


class _ProjectionKernel(nn.Module):
  """The kernel of `nn.DenseGeneral(features=(num_heads, depth), use_bias=False)` over d_model,
  without its product: the same parameter, path and initial values (initialised as a [d_model,
  d_model] matrix, as DenseGeneral does), so that projections can be stacked into one product."""

  config: TransformerConfig

  @nn.compact
  def __call__(self) -> Array:
    cfg = self.config
    shape = (cfg.d_model, cfg.num_heads, cfg.d_model // cfg.num_heads)
    init = lambda rng, shape, dtype: _dense_init()(rng, (shape[0], shape[1] * shape[2]),
                                                   dtype).reshape(shape)
    return self.param('kernel', init, shape, cfg.param_dtype)


def _project(cfg: TransformerConfig, x: Array, kernels: list[Array]) -> Array:
  """x [..., d_model] times each of the projections' `kernels`, in one product: [...,
  len(kernels), heads, depth] in cfg.dtype, as DenseGeneral promotes and multiplies."""
  x, kernel = nn.dtypes.promote_dtype(x, jnp.stack(kernels, axis=1), dtype=cfg.dtype)
  product = _matrix_product if cfg.attention_projection == 'matrix' else jax.lax.dot_general
  return product(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _even(query: Array, key: Array) -> bool:
  """Whether both lengths are even: cuDNN's backward pass with a mask needs them so."""
  return query.shape[1] % 2 == 0 and key.shape[1] % 2 == 0


class MultiHeadAttention(nn.Module):
  """Multi-head scaled dot-product attention (section 3.2) with a decoding cache.

  Written around `nn.dot_product_attention` because flax's MultiHeadDotProductAttention re-projects
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
    kernels = {name: _ProjectionKernel(cfg, name=name)() for name in ('query', 'key', 'value')}
    project = lambda inputs, *names: _project(cfg, inputs, [kernels[name] for name in names])
    output = nn.DenseGeneral(
        cfg.d_model, axis=(-2, -1), use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        kernel_init=_dense_init(), name='out',
        dot_general=_matrix_product if cfg.attention_projection == 'matrix' else None)
    keys_from = memory if self.cross else x
    if (cfg.attention_implementation == 'pallas' and not cfg.decode and
        max(x.shape[1], keys_from.shape[1]) <= fused_attention.MAX_LENGTH):
      # The projections of one input in one product each way, which the kernels read where they
      # lie and whose gradients they write into one array: no sum of their input gradients.
      if self.cross:
        stacked = project(memory, 'key', 'value')
        inputs = [project(x, 'query')[:, :, 0], *(fused_attention.Stacked(stacked, i)
                                                   for i in range(2))]
      else:
        stacked = project(x, 'query', 'key', 'value')
        inputs = [fused_attention.Stacked(stacked, i) for i in range(3)]
      return output(fused_attention.attention(*inputs, mask))
    out = None
    query = project(x, 'query')[:, :, 0]
    to_cache = lambda key, value: (key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3))
    if self.cross:
      if cfg.decode and self.has_variable('cache', 'cached_key'):
        out = cached_attention(query, self.get_variable('cache', 'cached_key'),
                               self.get_variable('cache', 'cached_value'), mask)
      else:
        key, value = (project(memory, name)[:, :, 0] for name in ('key', 'value'))
        if cfg.decode:  # cache set-up: the encoder output is projected once per sentence
          cached_key, cached_value = to_cache(key, value)
          self.put_variable('cache', 'cached_key', cached_key)
          self.put_variable('cache', 'cached_value', cached_value)
    else:
      key, value = (project(x, name)[:, :, 0] for name in ('key', 'value'))
      if cfg.decode:
        batch, length, heads, depth = key.shape
        cached_key = self.variable('cache', 'cached_key', jnp.zeros,
                                   (batch, heads, depth, length), key.dtype)
        cached_value = self.variable('cache', 'cached_value', jnp.zeros,
                                     (batch, heads, length, depth), value.dtype)
        if decode_index is not None:  # one step: write this position, attend to the prefix
          key, value = to_cache(key, value)
          cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key,
                                                          (0, 0, 0, decode_index))
          cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, value,
                                                            (0, 0, decode_index, 0))
          prefix = (jnp.arange(cached_key.value.shape[-1]) <= decode_index)[None, None, None, :]
          out = cached_attention(query, cached_key.value, cached_value.value, prefix)

    if out is None and cfg.attention_implementation == 'cudnn' and _even(query, key):
      # One fused kernel each way instead of XLA's matmuls, mask, softmax and transposes.
      out = jax.nn.dot_product_attention(query, key, value, mask=mask.astype(bool),
                                         implementation='cudnn')
    elif (out is None and cfg.attention_implementation == 'pallas' and
          max(query.shape[1], key.shape[1]) <= fused_attention.MAX_LENGTH):
      out = fused_attention.attention(query, key, value, mask)
    elif out is None:
      dropout_rng = None
      if not cfg.deterministic and cfg.attention_dropout_rate > 0:
        dropout_rng = self.make_rng('dropout')
      # module=self sows the softmax weights as intermediates/.../attention_weights, only when
      # the caller makes 'intermediates' mutable (transformer/attention.py); else it does nothing.
      out = nn.dot_product_attention(
          query, key, value, mask=mask, dropout_rng=dropout_rng,
          dropout_rate=cfg.attention_dropout_rate, deterministic=cfg.deterministic,
          dtype=cfg.dtype, force_fp32_for_softmax=True, module=self)
    return output(out)


@jax.custom_jvp
def relu(x: Array) -> Array:
  """max(0, x), its derivative read from the output rather than the input (jax.nn.relu's): the
  backward pass then keeps no pre-activation, and XLA can fuse the ReLU into the matmul before it
  (on a GPU, cuBLAS's bias-and-ReLU epilogue) instead of a pass of its own."""
  return jnp.maximum(x, 0)


# `out != 0`, not `out > 0`: XLA rewrites max(x, 0) > 0 as x > 0, which needs the pre-activation.
relu.defjvps(lambda tangent, out, x: jnp.where(out != 0, tangent, 0))


def _masked(x: Array, keep: Array, rate: float) -> Array:
  """nn.Dropout's output for the keep mask `keep`: kept values scaled by 1 / (1 - rate)."""
  return jax.lax.select(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _hash_dropped(x: Array, words: tuple[Array, Array], rate: float) -> Array:
  """nn.Dropout's output for a 'hash' key of these `hash_rng.mixed_words`."""
  return _masked(x, hash_rng.kept(hash_rng.bits(words, x.shape), 1.0 - rate), rate)


def _hash_dropped_grads(rate: float, words: tuple[Array, Array], grads: Array):
  # The barrier keeps XLA from finding the forward's draw in this one and keeping it after all.
  return _hash_dropped(grads, jax.lax.optimization_barrier(words), rate), None


# Written out so that the backward pass draws the mask again instead of keeping it: with the 'hash'
# bits, a few integer operations per element, the draw fuses into the kernels on either side, and
# the mask is neither written nor read (docs/speed.md).
_hash_dropout = jax.custom_vjp(_hash_dropped, nondiff_argnums=(2,))
_hash_dropout.defvjp(lambda x, words, rate: (_hash_dropped(x, words, rate), words),
                     _hash_dropped_grads)


def _is_hash_key(key: Array) -> bool:
  """Whether `key` is a typed key of transformer/hash_rng.py's generator."""
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and (
      jax.random.key_impl(key) == hash_rng.IMPL)


def dropout(x: Array, key: Array, rate: float) -> Array:
  """nn.Dropout's output for this key; a 'hash' key's mask is drawn again in the backward pass
  rather than kept (`_hash_dropout`)."""
  if _is_hash_key(key):
    return _hash_dropout(x, hash_rng.mixed_words(jax.random.key_data(key)), rate)
  return _masked(x, jax.random.bernoulli(key, 1.0 - rate, x.shape), rate)


class Dropout(nn.Module):
  """nn.Dropout(rate) without broadcast dimensions: the same output and gradients for the same
  'dropout' rng (`dropout`)."""

  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.make_rng('dropout'), self.rate)


class _DropoutKey(nn.Module):
  """The key a `Dropout` at this module's path draws."""

  @nn.compact
  def __call__(self) -> Array:
    return self.make_rng('dropout')


class _LayerNormParameters(nn.Module):
  """nn.LayerNorm's parameters for `features`, at this module's path: (scale, bias)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, features: int) -> tuple[Array, Array]:
    shape, dtype = (features,), self.config.param_dtype
    return (self.param('scale', nn.initializers.ones, shape, dtype),
            self.param('bias', nn.initializers.zeros, shape, dtype))


class FeedForward(nn.Module):
  """FFN(x) = max(0, x W1 + b1) W2 + b2 (section 3.3)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dense = functools.partial(
        nn.Dense, dtype=cfg.dtype, param_dtype=cfg.param_dtype, kernel_init=_dense_init())
    h = relu(dense(cfg.d_ff, name='hidden')(x))
    h = Dropout(cfg.relu_dropout_rate)(h, deterministic=cfg.deterministic)
    return dense(cfg.d_model, name='output')(h)


class Residual(nn.Module):
  """One sub-layer with dropout, residual connection and LayerNorm, post- or pre-norm."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, sublayer) -> Array:
    cfg = self.config
    norm = functools.partial(nn.LayerNorm, epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype, name='norm')
    if cfg.layer_norm == 'pre':
      return x + Dropout(cfg.dropout_rate)(sublayer(norm()(x)), deterministic=cfg.deterministic)
    out = sublayer(x)
    if cfg.norm_implementation == 'pallas' and not cfg.deterministic:
      # transformer/fused_norm.py, with nn.LayerNorm's parameters and Dropout's key at their paths.
      scale, bias = _LayerNormParameters(cfg, name='norm')(x.shape[-1])
      key_data, rate = None, cfg.dropout_rate
      if rate > 0:
        key = _DropoutKey(name='Dropout_0')()
        if _is_hash_key(key):
          key_data = jax.random.key_data(key)
        else:  # another generator: its dropout on its own
          out, rate = dropout(out, key, rate), 0.0
      return fused_norm.post_norm(x, out, scale, bias, key_data, rate, cfg.layer_norm_epsilon)
    return norm()(x + Dropout(cfg.dropout_rate)(out, deterministic=cfg.deterministic))


class EncoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array) -> Array:
    cfg = self.config
    attention = MultiHeadAttention(cfg, name='self_attention')
    x = Residual(cfg, name='self_attention_residual')(x, lambda y: attention(y, None, mask))
    return Residual(cfg, name='feed_forward_residual')(x, FeedForward(cfg, name='feed_forward'))


class DecoderLayer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, encoded, self_mask, cross_mask, decode_index=None) -> Array:
    cfg = self.config
    self_attention = MultiHeadAttention(cfg, name='self_attention')
    cross_attention = MultiHeadAttention(cfg, cross=True, name='cross_attention')
    x = Residual(cfg, name='self_attention_residual')(
        x, lambda y: self_attention(y, None, self_mask, decode_index))
    x = Residual(cfg, name='cross_attention_residual')(
        x, lambda y: cross_attention(y, encoded, cross_mask))
    return Residual(cfg, name='feed_forward_residual')(x, FeedForward(cfg, name='feed_forward'))


class Embedder(nn.Module):
  """Token embedding times sqrt(d_model), plus positional encoding, then dropout (section 3.4-3.5)."""

  config: TransformerConfig
  token_embedding: nn.Embed

  @nn.compact
  def __call__(self, tokens: Array, positions: Array) -> Array:
    cfg = self.config
    x = self.token_embedding(tokens).astype(cfg.dtype) * jnp.sqrt(cfg.d_model).astype(cfg.dtype)
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


def _default_positions(tokens: Array) -> Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)


class Encoder(nn.Module):
  """The encoder stack (section 3.1): embedding, then num_encoder_layers self-attention layers.

  Attributes:
    config: the architecture.
    token_embedding: the (possibly shared) token table.
  """

  config: TransformerConfig
  token_embedding: nn.Embed

  @nn.compact
  def __call__(self, sources, positions=None, segment_ids=None) -> Array:
    """The encoder's output.

    Args:
      sources: [batch, length] token ids, 0 = padding.
      positions: [batch, length] positions (packed rows restart at 0 per pair); default 0, 1, ...
      segment_ids: [batch, length] pair of each token in a packed row (1, 2, ...; 0 = padding);
        tokens attend only within their pair. None: one pair per row.

    Returns:
      [batch, length, d_model] states in config.dtype.
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
  num_decoder_layers of causal self-attention, cross-attention and feed-forward.

  Attributes:
    config: the architecture; with config.decode, one position per call over a cache.
    token_embedding: the (possibly shared) token table.
  """

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
      [batch, length, d_model] states in config.dtype.
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
    return _final_norm(cfg, y)


class Transformer(nn.Module):
  """Encoder-decoder; `__call__(sources, targets)` gives float32 logits [batch, target_len, vocab].

  Parameters: `source_embedding` (the shared table unless `share_embeddings=False`, which adds
  `target_embedding`), `encoder`, `decoder`, and `output_projection` only when
  `tie_output_embedding=False`.
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
    self.project_output = lambda y: project(y, output.embedding)

  def encode(self, sources, source_positions=None, source_segment_ids=None) -> Array:
    """The encoder's output [batch, length, d_model]; arguments as in `Encoder`."""
    return self.encoder(sources, source_positions, source_segment_ids)

  def decode(self, encoded, sources, targets, target_positions=None, source_segment_ids=None,
             target_segment_ids=None) -> Array:
    """Float32 logits [batch, length, vocab] for `targets`; arguments as in `Decoder`.

    With `config.decode`, call once with `targets` a [batch, max_length] placeholder and
    `mutable=['cache']` to set up the cache (this also projects the encoder output for
    cross-attention), then once per step with the previous token [batch, 1].
    """
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
        itself (`loss.projected_token_sums` with `output_table`).

    Returns:
      float32 logits [batch, target_length, vocab], or the decoder's output [batch,
      target_length, d_model] with `project=False`.
    """
    encoded = self.encode(sources, source_positions, source_segment_ids)
    if project:
      return self.decode(encoded, sources, targets, target_positions, source_segment_ids,
                         target_segment_ids)
    return self.decoder(encoded, sources, targets, target_positions, source_segment_ids,
                        target_segment_ids)


def resize_cache(cache, length: int):
  """The decoding cache with room for `length` target positions: the self-attention caches cut
  or zero-padded at the end (positions past the decoding index are never read)."""
  def resize(path, x):
    names = [getattr(k, 'key', None) for k in path]
    if 'self_attention' not in names:
      return x
    axis = 3 if names[-1] == 'cached_key' else 2  # keys [b, h, d, length], values [b, h, length, d]
    if x.shape[axis] >= length:
      return jax.lax.slice_in_dim(x, 0, length, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad)
  return jax.tree_util.tree_map_with_path(resize, cache)


def parameter_count(config: TransformerConfig) -> int:
  """Number of parameters, from shapes alone (nothing is allocated)."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
  return sum(x.size for x in jax.tree_util.tree_leaves(shapes['params']))


def project(states: Array, table: Array) -> Array:
  """Float32 logits of `states` [..., d_model] against an output table [vocab, d_model].

  The operands are in the states' dtype (the model's compute dtype) and the products are summed in
  float32: bfloat16 operands run at the matrix units' full rate, and the logits stay unrounded.
  """
  if states.dtype == jnp.float32:
    return jnp.dot(states, table.astype(jnp.float32).T)
  return _low_precision_project(states, table)


def _project_forward(states, table):
  return jnp.einsum('...d,vd->...v', states, table.astype(states.dtype),
                    preferred_element_type=jnp.float32)


def project_gradients(states: Array, table: Array, grads: Array) -> tuple[Array, Array]:
  """(d states, d table) of `project(states, table)` for the logits' gradient `grads`.

  The products run in the states' dtype and sum in float32, as the forward's: autodiff of the
  forward would multiply the float32 logit gradients with low-precision operands in float32.
  """
  dtype = states.dtype
  grads = grads.astype(dtype)
  return (jnp.einsum('...v,vd->...d', grads, table.astype(dtype),
                     preferred_element_type=jnp.float32).astype(dtype),
          jnp.einsum('...v,...d->vd', grads, states,
                     preferred_element_type=jnp.float32).astype(table.dtype))


_low_precision_project = jax.custom_vjp(_project_forward)
_low_precision_project.defvjp(
    lambda states, table: (_project_forward(states, table), (states, table)),
    lambda residuals, grads: project_gradients(*residuals, grads))


def output_table(params) -> Array:
  """The pre-softmax projection as a [vocab, d_model] table: logits = output . table^T."""
  if 'output_projection' in params:
    return params['output_projection']['embedding']
  return params.get('target_embedding', params['source_embedding'])['embedding']


def parameters_per_token(params) -> tuple[int, int]:
  """Parameters used per source token (encoder) and per target token (decoder + projection)."""
  size = lambda tree: sum(x.size for x in jax.tree_util.tree_leaves(tree))
  embedding = params['source_embedding']['embedding'].size
  decoder = size(params['decoder']) + size(params.get('output_projection', {})) + (
      embedding if 'output_projection' not in params else 0)
  return size(params['encoder']), decoder
