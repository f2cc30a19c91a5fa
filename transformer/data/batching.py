"""Length-grouped token batches for data-parallel training and evaluation, resumable by position.

config.tokens_per_batch is the global budget of source (and of target) tokens per optimizer update;
each device's micro-batch gets tokens_per_batch // (grad_accum_steps * process_count * num_devices)
slots per side. A batch is [num_devices, rows, length] with `length` from a small fixed set
(`bucket_lengths`), so XLA compiles a bounded number of programs:
- default: one pair per row, pairs grouped by their longer side into the bucket that fits it;
- config.packing: several pairs per max_length row, with segment ids (1, 2, ...; 0 = padding) and
  positions restarting at 0 for each pair.
Pairs with an empty side, or a side longer than max_length tokens (EOS included), are dropped and
counted, never truncated.

Every host computes the same global plan from the lengths of all pairs and fills only its own
devices' rows: hosts agree on each batch's shape without talking, and the batches do not depend on
how the devices are spread over hosts. A training epoch's plan is a pure function of (seed, epoch)
with a fixed number of batches, so batch n is found without replaying batches 0..n-1; this is why
the pipeline is written by hand (numpy) rather than with tf.data or grain.
"""

import dataclasses

import ml_collections
import numpy as np
from absl import logging

from transformer.data import sources
from transformer.data.errors import DataError
from transformer.data.vocabulary import EOS_ID, Vocabulary

ENCODE_CHUNK = 10_000  # pairs read and tokenized at a time
PACKING_WINDOW = 16  # open rows a pair may join: more fills rows better but packs slower


def bucket_lengths(max_length: int) -> list[int]:
  """Padded lengths: multiples of 8 up to 64, then steps of about 1/4, and max_length itself."""
  lengths, length = [], 8
  while length < max_length:
    lengths.append(length)
    length += max(8, length // 32 * 8)
  return lengths + [max_length]


class _Ragged:
  """Token sequences of different lengths, stored flat."""

  def __init__(self, chunks: list[np.ndarray], lengths: list[np.ndarray]):
    self.tokens = np.concatenate(chunks)
    self.lengths = np.concatenate(lengths)
    self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])

  def __getitem__(self, i: int) -> np.ndarray:
    return self.tokens[self.offsets[i]:self.offsets[i + 1]]


@dataclasses.dataclass
class EncodedSplit:
  """A split's usable pairs as token ids ending in EOS; pair k is corpus pair `indices[k]`."""

  name: str
  indices: np.ndarray
  sources: _Ragged
  targets: _Ragged
  dropped_empty: int
  dropped_too_long: int

  def __len__(self) -> int:
    return len(self.indices)

  @property
  def longest(self) -> np.ndarray:
    """Each pair's longer side, in tokens."""
    return np.maximum(self.sources.lengths, self.targets.lengths)


def encode_split(config: ml_collections.ConfigDict, vocab: Vocabulary, split: str) -> EncodedSplit:
  """Tokenizes a whole split (all hosts need every length to agree on one plan)."""
  corpus = sources.load_split(config, split)
  dtype = np.uint16 if vocab.vocab_size <= 2**16 else np.int32
  kept, empty, too_long = [], 0, 0
  sides = ([], []), ([], [])  # (token chunks, length chunks) per side
  for start in range(0, len(corpus), ENCODE_CHUNK):
    chunk = range(start, min(start + ENCODE_CHUNK, len(corpus)))
    encoded = [vocab.encode_batch(texts) for texts in corpus.texts(chunk)]
    chunk_kept = []
    for index, source, target in zip(chunk, *encoded):
      if not source or not target:
        empty += 1
      elif max(len(source), len(target)) + 1 > config.max_length:
        too_long += 1
      else:
        chunk_kept.append((source, target))
        kept.append(index)
    for (tokens, lengths), sequences in zip(sides, zip(*chunk_kept) if chunk_kept else ((), ())):
      tokens.append(np.array([t for s in sequences for t in (*s, EOS_ID)], dtype))
      lengths.append(np.array([len(s) + 1 for s in sequences], np.int64))
  logging.info('%s: %d pairs; dropped %d with an empty side and %d longer than max_length=%d '
               'tokens', corpus.name, len(kept), empty, too_long, config.max_length)
  if not kept:
    raise DataError(f'{corpus.name}: no usable pairs ({empty} empty, {too_long} longer than '
                    f'config.max_length={config.max_length}); check the data or raise max_length')
  return EncodedSplit(corpus.name, np.array(kept, np.int64), _Ragged(*sides[0]),
                      _Ragged(*sides[1]), empty, too_long)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a global batch goes: `tokens` slots per side on each of all hosts' devices."""

  tokens: int
  process_index: int
  process_count: int
  num_devices: int

  def rows_per_device(self, length: int) -> int:
    return self.tokens // length

  def global_rows(self, length: int) -> int:
    return self.rows_per_device(length) * self.process_count * self.num_devices


def layout(config: ml_collections.ConfigDict, process_index: int, process_count: int,
           num_devices: int) -> Layout:
  """The per-device token budget of this host's share; DataError if a row would not fit."""
  if not 0 <= process_index < process_count or num_devices < 1:
    raise DataError(f'process_index={process_index}, process_count={process_count}, '
                    f'num_devices={num_devices}: need 0 <= process_index < process_count and '
                    'num_devices >= 1')
  splits = config.grad_accum_steps * process_count * num_devices
  tokens = config.tokens_per_batch // splits
  if tokens < config.max_length:
    raise DataError(f'config.tokens_per_batch={config.tokens_per_batch} leaves {tokens} tokens '
                    f'per device micro-batch (grad_accum_steps * processes * devices = {splits}), '
                    f'fewer than config.max_length={config.max_length}; raise tokens_per_batch '
                    'or lower grad_accum_steps')
  return Layout(tokens, process_index, process_count, num_devices)


def fill(encoded: EncodedSplit, rows, length: int, where: Layout, packing: bool) -> dict:
  """This host's part of a global batch whose rows hold the listed pairs; missing rows are 0."""
  per_device = where.rows_per_device(length)
  host_rows = per_device * where.num_devices
  first = where.process_index * host_rows
  names = ['sources', 'targets']
  if packing:
    names += ['source_segment_ids', 'source_positions', 'target_segment_ids', 'target_positions']
  arrays = {name: np.zeros((host_rows, length), np.int32) for name in names}
  for row, pairs in enumerate(rows[first:first + host_rows]):
    for side, ragged in (('source', encoded.sources), ('target', encoded.targets)):
      start = 0
      for segment, pair in enumerate(pairs, 1):
        ids = ragged[pair]
        end = start + len(ids)
        arrays[f'{side}s'][row, start:end] = ids
        if packing:
          arrays[f'{side}_segment_ids'][row, start:end] = segment
          arrays[f'{side}_positions'][row, start:end] = np.arange(len(ids))
        start = end
  return {name: a.reshape(where.num_devices, per_device, length) for name, a in arrays.items()}


def pack(source_lengths, target_lengths, order, length: int) -> list[list[int]]:
  """Rows of pairs (taken in `order`) whose source and target lengths each sum to <= length."""
  source_lengths, target_lengths = source_lengths.tolist(), target_lengths.tolist()
  rows, open_rows = [], []  # open rows: [source tokens, target tokens, pairs]
  for pair in order.tolist():
    source, target = source_lengths[pair], target_lengths[pair]
    for row in open_rows:  # first fit
      if row[0] + source <= length and row[1] + target <= length:
        row[0] += source
        row[1] += target
        row[2].append(pair)
        break
    else:
      open_rows.append([source, target, [pair]])
      if len(open_rows) > PACKING_WINDOW:
        rows.append(open_rows.pop(0)[2])
  return rows + [row[2] for row in open_rows]


def _bucketed_epoch(encoded: EncodedSplit, buckets: list[int], where: Layout, rng) -> list:
  """Pairs shuffled within their bucket, cut into batches; the batch order shuffled."""
  bucket_of = np.searchsorted(buckets, encoded.longest)
  batches = []
  for bucket, length in enumerate(buckets):
    pairs = rng.permutation(np.flatnonzero(bucket_of == bucket))[:, None]  # one pair per row
    size = where.global_rows(length)
    batches += [(length, pairs[s:s + size]) for s in range(0, len(pairs), size)]
  return [batches[i] for i in rng.permutation(len(batches))]


def _packed_epoch(rows: list[list[int]], length: int, where: Layout, rng) -> list:
  order = rng.permutation(len(rows))
  size = where.global_rows(length)
  return [(length, [rows[i] for i in order[s:s + size]]) for s in range(0, len(order), size)]


class TrainBatches:
  """Endless training batches; `position` (batches yielded so far) is the state to checkpoint.

  Each epoch sees every usable pair once, in an order fixed by (config.seed, epoch). With packing,
  the rows are packed once (from config.seed) and reshuffled into batches each epoch, so every
  epoch has the same number of batches.
  """

  def __init__(self, config: ml_collections.ConfigDict, encoded: EncodedSplit, where: Layout,
               start_position: int):
    self.position = start_position
    self._config, self._encoded, self._where = config, encoded, where
    self._buckets = bucket_lengths(config.max_length)
    if config.packing:
      order = np.random.default_rng(config.seed).permutation(len(encoded))
      self._rows = pack(encoded.sources.lengths, encoded.targets.lengths, order,
                        config.max_length)
    self._epoch, self._plan = None, None
    self.batches_per_epoch = len(self._epoch_plan(0))

  def _epoch_plan(self, epoch: int) -> list:
    if epoch != self._epoch:
      rng = np.random.default_rng([self._config.seed, epoch])
      if self._config.packing:
        self._plan = _packed_epoch(self._rows, self._config.max_length, self._where, rng)
      else:
        self._plan = _bucketed_epoch(self._encoded, self._buckets, self._where, rng)
      self._epoch = epoch
    return self._plan

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    epoch, index = divmod(self.position, self.batches_per_epoch)
    length, rows = self._epoch_plan(epoch)[index]
    self.position += 1
    return fill(self._encoded, rows, length, self._where, self._config.packing)


def _eval_plan(encoded: EncodedSplit, buckets: list[int], where: Layout) -> list:
  """Consecutive pairs, each batch as many as fit the bucket of its longest pair."""
  def bucket(n: int) -> int:
    return buckets[int(np.searchsorted(buckets, n))]

  batches, current, current_longest = [], [], 0
  for pair, n in enumerate(encoded.longest.tolist()):
    if current and len(current) >= where.global_rows(bucket(max(current_longest, n))):
      batches.append((bucket(current_longest), [[p] for p in current]))
      current, current_longest = [], 0
    current.append(pair)
    current_longest = max(current_longest, n)
  batches.append((bucket(current_longest), [[p] for p in current]))
  return batches


def train_batches(config: ml_collections.ConfigDict, vocab: Vocabulary, process_index: int = 0,
                  process_count: int = 1, num_devices: int = 1,
                  start_position: int = 0) -> TrainBatches:
  """Endless training batches for this host, from batch number `start_position` on."""
  where = layout(config, process_index, process_count, num_devices)
  return TrainBatches(config, encode_split(config, vocab, 'train'), where, start_position)


def eval_batches(config: ml_collections.ConfigDict, vocab: Vocabulary, split: str,
                 process_index: int = 0, process_count: int = 1, num_devices: int = 1):
  """One pass over `split` in its order; rows past the end of the split are all padding."""
  where = layout(config, process_index, process_count, num_devices)
  encoded = encode_split(config, vocab, split)
  plan = _eval_plan(encoded, bucket_lengths(config.max_length), where)
  return (fill(encoded, rows, length, where, config.packing) for length, rows in plan)
