"""Length-grouped token batches for data-parallel training and evaluation, resumable by position.

config.tokens_per_batch is the global budget of real (non-padding) source tokens, and of target
tokens, per optimizer update, as the paper counts its ~25000 + 25000; each device's micro-batch
gets tokens_per_batch // (grad_accum_steps * all devices) of it. A batch is [local devices, rows,
length] with `length` from a small fixed set (`bucket_lengths`), so XLA compiles a bounded number
of programs. A length gets as many batches as the budget needs for its rows, at the budget over
the mean real tokens per row of that length on the side with more (from the whole split, all
shards), and its batches then as many rows as share the fullest shard's rows out evenly: at most
the budget's. A row holds
- one pair: pairs are grouped by their longer side into the shortest length that fits (default);
- with config.packing, several pairs in max_length slots, with segment ids (1, 2, ...; 0 = padding)
  and positions restarting at 0 for each pair.
Pairs with an empty side, or a side longer than max_length tokens (EOS included), are dropped and
counted, never truncated.

The data is sharded by device, not by host: of D devices in all, device d owns every D-th pair of
a permutation of the split drawn from config.seed (a random sample, however the corpus is
ordered), and a host takes only its own devices' shards from the split's token ids, tokenized
once and stored for every run and host (token_store.py). The hosts then all-gather
one small table (each shard's row count and mean tokens per row, per length) and compute the same
plan from it: the sequence of batch lengths, each length as often as the fullest shard needs. Every
device fills each batch from its own shard, spreading its rows of that length evenly over the
batches of that length (a smaller shard leaves a few rows as padding). So hosts agree on every
batch's shape, and a batch does not depend on how the devices are spread over hosts. A training
epoch's plan is a pure function of (seed, epoch) with a fixed number of batches, so batch n is
found without replaying batches 0..n-1; this is why the pipeline is written by hand (numpy)
rather than with tf.data or grain.
"""

import dataclasses
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from transformer.data import sources, token_store
from transformer.data.errors import DataError
from transformer.data.token_store import Ragged, Tokenized
from transformer.data.vocabulary import Vocabulary

PACKING_WINDOW = 16  # open rows a pair may join: more fills rows better but packs slower
SHARDING, PACKING, BATCH_ORDER, ROW_ORDER = range(4)  # the random choices made from config.seed


def bucket_lengths(max_length: int) -> list[int]:
  """Padded lengths: multiples of 8 up to 64, then steps of about 1/4, and max_length itself."""
  lengths, length = [], 8
  while length < max_length:
    lengths.append(length)
    length += max(8, length // 32 * 8)
  return lengths + [max_length]


@dataclasses.dataclass
class EncodedSplit:
  """Usable pairs as token ids ending in EOS; pair k is corpus pair `indices[k]`."""

  name: str
  indices: np.ndarray
  sources: Ragged
  targets: Ragged
  dropped_empty: int
  dropped_too_long: int

  def __len__(self) -> int:
    return len(self.indices)

  @property
  def longest(self) -> np.ndarray:
    """Each pair's longer side, in tokens."""
    return np.maximum(self.sources.lengths, self.targets.lengths)


def select(tokenized: Tokenized, max_length: int, indices: np.ndarray) -> EncodedSplit:
  """The pairs at `indices` (ascending), dropping those with an empty side or a side longer than
  max_length tokens (EOS included)."""
  source, target = tokenized.sources.lengths[indices], tokenized.targets.lengths[indices]
  empty = (source <= 1) | (target <= 1)  # EOS alone
  too_long = ~empty & (np.maximum(source, target) > max_length)
  kept = indices[~empty & ~too_long]
  return EncodedSplit(tokenized.name, kept, tokenized.sources.take(kept),
                      tokenized.targets.take(kept), int(empty.sum()), int(too_long.sum()))


@dataclasses.dataclass(frozen=True)
class Layout:
  """This host's devices among all: device d of `num_shards` owns shard d of every split."""

  tokens: int  # real tokens per side in one device's micro-batch, on average
  devices: range
  num_shards: int


def layout(config: ml_collections.ConfigDict, process_index: int, process_count: int,
           num_devices: int) -> Layout:
  """This host's share of a global batch; DataError if a row would not fit a device's budget."""
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
  first = process_index * num_devices
  return Layout(tokens, range(first, first + num_devices), process_count * num_devices)


def rng(seed: int, purpose: int, epoch: int = 0, device: int = 0) -> np.random.Generator:
  """An independent random stream for each purpose, epoch and device, all from the seed."""
  return np.random.default_rng([seed, purpose, epoch, device])


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


@dataclasses.dataclass
class Shard:
  """One device's pairs arranged in rows: `rows[r]` lists the pairs of row r."""

  encoded: EncodedSplit
  rows: Ragged
  rows_by_length: list[np.ndarray]  # per bucket length: the ids of the rows of that length

  def milli_tokens_per_row(self) -> list[int]:
    """Per bucket length: the mean real tokens of its rows on the side with more, x 1000."""
    row_of_pair = np.repeat(np.arange(len(self.rows.lengths)), self.rows.lengths)
    per_row = [np.bincount(row_of_pair, ragged.lengths[self.rows.flat],
                           minlength=len(self.rows.lengths))
               for ragged in (self.encoded.sources, self.encoded.targets)]
    return [round(1000 * max(side[ids].mean() for side in per_row)) if len(ids) else 0
            for ids in self.rows_by_length]


def arrange(encoded: EncodedSplit, buckets: list[int], packing: bool, seed: int,
            device: int) -> Shard:
  """One pair per row in the bucket that fits it, or pairs packed (once, from the seed) into
  max_length rows."""
  if packing:
    order = rng(seed, PACKING, device=device).permutation(len(encoded))
    packed = pack(encoded.sources.lengths, encoded.targets.lengths, order, buckets[-1])
    rows = Ragged(np.array([p for row in packed for p in row], np.int64),
                  np.array([len(row) for row in packed], np.int64))
    by_length = [np.zeros(0, np.int64)] * (len(buckets) - 1) + [np.arange(len(packed))]
  else:
    rows = Ragged(np.arange(len(encoded)), np.ones(len(encoded), np.int64))
    bucket_of = np.searchsorted(buckets, encoded.longest)
    by_length = [np.flatnonzero(bucket_of == b) for b in range(len(buckets))]
  return Shard(encoded, rows, by_length)


def split_shards(tokenized: Tokenized, config: ml_collections.ConfigDict, devices: range,
                 num_shards: int, pack_rows: bool) -> list[Shard]:
  """The shards of `devices` among `num_shards`: device d's pairs are every num_shards-th of a
  permutation drawn from config.seed, arranged in rows."""
  order = rng(config.seed, SHARDING).permutation(len(tokenized))
  return [arrange(select(tokenized, config.max_length, np.sort(order[device::num_shards])),
                  bucket_lengths(config.max_length), pack_rows, config.seed, device)
          for device in devices]


def shard_table(shards: list[Shard]) -> np.ndarray:
  """A row per shard, what every host needs of it to plan: its usable and dropped pairs, then its
  rows per bucket length, then their mean real tokens (x 1000) on the side with more."""
  return np.array([[len(s.encoded), s.encoded.dropped_empty, s.encoded.dropped_too_long,
                    *map(len, s.rows_by_length), *s.milli_tokens_per_row()]
                   for s in shards], np.int32)


def budget_rows(table: np.ndarray, tokens: int) -> list[int]:
  """Per bucket length, the rows that hold `tokens` real tokens per side: the budget over the mean
  real tokens per row of that length on the side with more, over every shard's `shard_table`
  row."""
  rows, milli_tokens = np.split(table[:, 3:].astype(np.int64), 2, axis=1)
  return [max(1, 1000 * tokens * int(rows[:, b].sum()) // int(rows[:, b] @ milli_tokens[:, b]))
          if rows[:, b].any() else 1 for b in range(rows.shape[1])]


def plan_rows(table: np.ndarray, tokens: int) -> tuple[list[int], list[int]]:
  """(batches, rows per batch) of each bucket length, from every shard's `shard_table` row and
  the real tokens per side of a device's micro-batch.

  A length gets as many batches as its fullest shard needs at the budget's rows, and then batches
  just large enough for it: no row that every shard leaves empty is computed (at Multi30k's 18
  batches an epoch, the budget's rows left 5% of them empty).
  """
  fullest = table[:, 3:3 + (table.shape[1] - 3) // 2].max(axis=0).tolist()
  batches = [-(-n // size) for n, size in zip(fullest, budget_rows(table, tokens))]
  return batches, [-(-n // count) if count else 1 for n, count in zip(fullest, batches)]

def all_hosts(local: np.ndarray) -> np.ndarray:
  """Every host's `local` [its devices, ...] concatenated in process order: [all devices, ...]."""
  if jax.process_count() == 1:
    return local
  return np.asarray(multihost_utils.process_allgather(local, tiled=True))


AllGather = Callable[[np.ndarray], np.ndarray]


def batch_names(packed: bool) -> list[str]:
  """The int32 arrays of a batch: token ids, and with packed rows segment ids and positions."""
  return ['sources', 'targets'] + (['source_segment_ids', 'source_positions',
                                    'target_segment_ids', 'target_positions'] if packed else [])


class Batches:
  """A split's batches on this host: one plan shared by all hosts, filled from local shards."""

  def __init__(self, config: ml_collections.ConfigDict, vocab: Vocabulary, split: str,
               where: Layout, pack_rows: bool, all_gather: AllGather,
               corpus: sources.Corpus | None = None):
    self.buckets = bucket_lengths(config.max_length)
    # Packed batches, even those of single-pair rows, carry segment ids and positions.
    self.where, self._segments, self._seed = where, pack_rows, config.seed
    tokenized = token_store.load_or_tokenize(config, corpus or sources.load_split(config, split),
                                             vocab)
    self.shards = split_shards(tokenized, config, where.devices, where.num_shards, pack_rows)
    table = all_gather(shard_table(self.shards)).astype(np.int64)
    if table.shape != (where.num_shards, 3 + 2 * len(self.buckets)):
      raise DataError(f'all_gather returned {len(table)} shard rows for {where.num_shards} '
                      'devices: process_count and num_devices must describe the running hosts')
    usable, empty, too_long = table[:, :3].sum(axis=0).tolist()
    logging.info('%s: %d pairs in %d shards; dropped %d with an empty side and %d longer than '
                 'max_length=%d tokens', tokenized.name, usable, where.num_shards, empty, too_long,
                 config.max_length)
    if not usable:
      raise DataError(f'{tokenized.name}: no usable pairs ({empty} empty, {too_long} longer than '
                      f'config.max_length={config.max_length}); check the data or raise '
                      'max_length')
    self.batches_per_length, self.rows_per_batch = plan_rows(table, where.tokens)
    logging.info('%s: %d batches of [rows x length] %s per device, ~%d real tokens per side',
                 tokenized.name, sum(self.batches_per_length),
                 ', '.join(f'{r}x{length}' for r, length, n in zip(
                     self.rows_per_batch, self.buckets, self.batches_per_length) if n),
                 where.tokens)
    rows, milli_tokens = np.split(table[:, 3:], 2, axis=1)
    held = int((rows * milli_tokens).sum(axis=1).max()) // 1000  # by the fullest shard
    if split == 'train' and held < where.tokens:
      logging.warning('%s: config.tokens_per_batch=%d is more than the split holds (the '
                      "fullest device's share: %d real tokens per side): an epoch is %d step(s), "
                      'a batch per length; lower tokens_per_batch for more, smaller steps',
                      tokenized.name, config.tokens_per_batch, held,
                      sum(self.batches_per_length))

  def plan(self, epoch: int | None) -> list[tuple[int, list[np.ndarray]]]:
    """(length, each local device's row ids) per batch: shuffled by (seed, epoch), or in order."""
    order = np.repeat(np.arange(len(self.buckets)), self.batches_per_length)
    if epoch is not None:
      order = rng(self._seed, BATCH_ORDER, epoch).permutation(order)
    per_device = []  # [device][bucket] -> row-id chunks, one per batch of that bucket
    for device, shard in zip(self.where.devices, self.shards):
      rows = None if epoch is None else rng(self._seed, ROW_ORDER, epoch, device)
      per_device.append([np.array_split(ids if rows is None else rows.permutation(ids), count)
                         if count else []
                         for ids, count in zip(shard.rows_by_length, self.batches_per_length)])
    taken = [0] * len(self.buckets)
    batches = []
    for bucket in order.tolist():
      batches.append((self.buckets[bucket], [chunks[bucket][taken[bucket]]
                                             for chunks in per_device]))
      taken[bucket] += 1
    return batches

  def fill(self, length: int, device_rows: list[np.ndarray]) -> dict:
    """The [local devices, rows, length] arrays of one batch; rows past a device's own are 0."""
    shape = (len(self.shards), self.rows_per_batch[self.buckets.index(length)], length)
    arrays = {name: np.zeros(shape, np.int32) for name in batch_names(self._segments)}
    # Vectorised over rows and pairs: on a GPU the host has a few milliseconds per step for it
    # and the step's dispatch.
    for device, (shard, row_ids) in enumerate(zip(self.shards, device_rows)):
      pairs = shard.rows.take(row_ids)  # the pair ids of each row, back to back
      row_of_pair = np.repeat(np.arange(len(row_ids)), pairs.lengths)
      segment_of_pair = np.arange(len(pairs.flat)) - np.repeat(pairs.offsets[:-1], pairs.lengths)
      for side, ragged in (('source', shard.encoded.sources), ('target', shard.encoded.targets)):
        tokens = ragged.take(pairs.flat)
        row = np.repeat(row_of_pair, tokens.lengths)
        row_tokens = np.bincount(row_of_pair, tokens.lengths, len(row_ids)).astype(np.int64)
        index = np.arange(len(tokens.flat))
        column = index - (np.cumsum(row_tokens) - row_tokens)[row]
        arrays[f'{side}s'][device, row, column] = tokens.flat
        if self._segments:
          arrays[f'{side}_segment_ids'][device, row, column] = np.repeat(segment_of_pair + 1,
                                                                         tokens.lengths)
          arrays[f'{side}_positions'][device, row, column] = index - np.repeat(
              tokens.offsets[:-1], tokens.lengths)
    return arrays


class TrainBatches:
  """Endless training batches; `position` (batches yielded so far) is the state to checkpoint.

  Each epoch sees every usable pair once, in an order fixed by (config.seed, epoch). With packing,
  the rows are packed once (from config.seed) and reshuffled into batches each epoch, so every
  epoch has the same number of batches.
  """

  def __init__(self, batches: Batches, start_position: int):
    self.position = start_position
    self._batches = batches
    self._epoch, self._plan = None, None
    self.batches_per_epoch = sum(batches.batches_per_length)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    epoch, index = divmod(self.position, self.batches_per_epoch)
    if epoch != self._epoch:
      self._epoch, self._plan = epoch, self._batches.plan(epoch)
    self.position += 1
    return self._batches.fill(*self._plan[index])


def train_batches(config: ml_collections.ConfigDict, vocab: Vocabulary, process_index: int = 0,
                  process_count: int = 1, num_devices: int = 1, start_position: int = 0,
                  all_gather: AllGather = all_hosts,
                  corpus: sources.Corpus | None = None) -> TrainBatches:
  """Endless training batches for this host, from batch number `start_position` on.

  Every host calls it at once: `all_gather` exchanges the hosts' shard sizes.

  Args:
    config: a validated config (data keys, tokens_per_batch, max_length, packing, seed, ...).
    vocab: the run's vocabulary.
    process_index: this host.
    process_count: hosts in all.
    num_devices: this host's devices.
    start_position: batches already trained on (a checkpoint's data position).
    all_gather: stacks every host's array in process order (`all_hosts`; tests pass a stand-in).
    corpus: the training split (`load_split`), if already loaded.

  Returns:
    A `TrainBatches` iterator of dicts of int32 [num_devices, rows, length] arrays (see the
    package docstring); its `position` is what a checkpoint stores.

  Raises:
    DataError: unusable data or data settings; the message names the key or file.
  """
  where = layout(config, process_index, process_count, num_devices)
  return TrainBatches(Batches(config, vocab, 'train', where, config.packing, all_gather, corpus),
                      start_position)


def eval_batches(config: ml_collections.ConfigDict, vocab: Vocabulary, split: str,
                 process_index: int = 0, process_count: int = 1, num_devices: int = 1,
                 all_gather: AllGather = all_hosts, corpus: sources.Corpus | None = None):
  """One pass over `split`, its pairs packed into max_length rows whatever config.packing: one
  shape to compile and little padding, and the loss sums of separate rows (segments never attend
  across). Unused rows are all padding.

  Args:
    config, vocab, process_index, process_count, num_devices, all_gather: as in `train_batches`.
    split: 'validation' or 'test'.
    corpus: `split` read already (`sources.load_split`), e.g. one pair of a multilingual config.

  Returns:
    An iterator of packed batches: every usable pair of the split once.
  """
  where = layout(config, process_index, process_count, num_devices)
  batches = Batches(config, vocab, split, where, True, all_gather, corpus)
  return (batches.fill(length, rows) for length, rows in batches.plan(None))
