"""The input pipeline: sources, vocabulary, length-grouped and packed batches, resume, sharding."""

import codecs
import collections
import concurrent.futures
import gzip
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from conftest import error_line, run_script
from configs import default, multi30k, tiny
from transformer import config as config_lib
from transformer import data
from transformer.data import batching, sources, synthetic, token_store, vocabulary
from transformer.data import multi30k as multi30k_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text_config(tmp_path, **overrides):
  """dataset='text' over distinct generated sentences of 1-40 words (some pairs too long)."""
  rng = np.random.default_rng(0)
  words = [''.join(rng.choice(list('abcdefghij'), rng.integers(1, 5))) for _ in range(50)]
  for split, size in (('train', 600), ('validation', 90)):
    sentences = {}  # a dict keeps the order
    while len(sentences) < size:
      sentences[' '.join(rng.choice(words, rng.integers(1, 41)))] = None
    for lang, lines in (('en', sentences), ('de', [s.upper() for s in sentences])):
      (tmp_path / f'{split}.{lang}').write_text(''.join(f'{line}\n' for line in lines))
  config = default.get_config()
  config.update(dataset='text', train_files=str(tmp_path / 'train.{lang}'),
                validation_files=str(tmp_path / 'validation.{lang}'), vocab_size=352,
                max_length=32, tokens_per_batch=512, **overrides)
  return config_lib.validate(config)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """A text config, its vocabulary and its encoded training split."""
  tmp_path = tmp_path_factory.mktemp('text')
  config = text_config(tmp_path)
  vocab = data.load_or_train_vocabulary(config, str(tmp_path / 'workdir'))
  return config, vocab, encode_all(config, vocab, 'train')


def encode_all(config, vocab, split) -> batching.EncodedSplit:
  tokenized = token_store.load_or_tokenize(config, sources.load_split(config, split), vocab)
  return batching.select(tokenized, config.max_length, np.arange(len(tokenized)))


def simulated_hosts(build, process_count: int) -> list:
  """[build(i, all_gather) for each host i], run at once on threads that all-gather as hosts do."""
  barrier = threading.Barrier(process_count)
  tables = [None] * process_count

  def host(i):
    def all_gather(local):
      tables[i] = local
      barrier.wait()
      table = np.concatenate(tables)
      barrier.wait()  # all have read the tables before any host gathers again
      return table

    threading.current_thread().name = f'host {i}'
    return build(i, all_gather)

  with concurrent.futures.ThreadPoolExecutor(process_count) as pool:
    return list(pool.map(host, range(process_count)))


def real_tokens_per_batch(batches) -> float:
  """Over the next epoch, the mean real tokens per device and batch on the side with more."""
  epoch = take(batches, batches.batches_per_epoch)
  devices = epoch[0]['sources'].shape[0]
  return max(sum(int((b[side] > 0).sum()) for b in epoch)
             for side in ('sources', 'targets')) / (devices * len(epoch))


def pairs_in(batch) -> list:
  """The (source, target) token tuples of every pair in a batch, row by row."""
  pairs = []
  sources = batch['sources'].reshape(-1, batch['sources'].shape[-1])
  targets = batch['targets'].reshape(-1, batch['targets'].shape[-1])
  source_segments = batch.get('source_segment_ids', batch['sources'] > 0).reshape(sources.shape)
  target_segments = batch.get('target_segment_ids', batch['targets'] > 0).reshape(targets.shape)
  for row in range(len(sources)):
    for segment in range(1, int(source_segments[row].max(initial=0)) + 1):
      pairs.append((tuple(sources[row][source_segments[row] == segment]),
                    tuple(targets[row][target_segments[row] == segment])))
  return pairs


def all_pairs(encoded) -> collections.Counter:
  return collections.Counter((tuple(encoded.sources[k]), tuple(encoded.targets[k]))
                             for k in range(len(encoded)))


def take(iterator, n) -> list:
  return [next(iterator) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


# Vocabulary.

def test_special_ids_and_round_trip(corpus):
  config, vocab, _ = corpus
  assert (data.PAD_ID, data.EOS_ID, data.UNK_ID) == (0, 1, 2)
  assert vocab.vocab_size == config.vocab_size
  text = 'abc dje ifgh'
  ids = vocab.encode(text)
  assert ids and min(ids) > data.UNK_ID  # no pad, EOS or unk in known text
  assert vocab.decode(ids) == text
  assert vocab.decode([0] + ids + [data.EOS_ID] + vocab.encode('zzz')) == text
  # Characters the training text lacks come back as written, spelled in UTF-8 bytes; the last
  # line would change under NFKC normalisation (ligature, full-width letter, fraction).
  for unseen in ('xyz', 'Grüße, 日本 😀', 'ﬁ Ａ ½'):
    ids = vocab.encode(unseen)
    assert data.UNK_ID not in ids and vocab.decode(ids) == unseen


def test_vocabulary_is_trained_once_kept_beside_the_data_and_copied_to_each_workdir(
    tmp_path, monkeypatch, caplog):
  config = tiny.get_config()
  config.tfds_data_dir = str(tmp_path / 'prepared')
  workdir = str(tmp_path / 'run')
  with caplog.at_level(logging.INFO, logger='absl'):
    first = data.load_or_train_vocabulary(config, workdir)
  assert os.listdir(tmp_path / 'run' / 'vocab') == ['sentencepiece.model']  # no temp file left
  stored = vocabulary.stored_path(config, sources.load_split(config, 'train'))
  assert stored.startswith(f'{tmp_path}/prepared/vocabularies/')
  assert pathlib.Path(stored).read_bytes() == (tmp_path / 'run' / 'vocab' / 'sentencepiece.model'
                                               ).read_bytes()
  # It says what it does, and when it is done.
  said = [r.getMessage() for r in caplog.records]
  assert said[0] == 'training a 320-piece bpe vocabulary on 4000 sentences of synthetic (train)'
  assert re.fullmatch(rf'vocabulary trained in [\d.]+ s: {stored}', said[-1])

  def fail(config, corpus):
    raise AssertionError('trained again')

  monkeypatch.setattr(vocabulary, 'train_model', fail)
  for process_index in (0, 1):  # other hosts load what process 0 wrote
    again = data.load_or_train_vocabulary(config, workdir, process_index=process_index)
    sentence = synthetic.pairs('validation')[0][0]
    assert again.encode(sentence) == first.encode(sentence)
  # Another run of the same data and settings copies the stored one.
  other = data.load_or_train_vocabulary(config, str(tmp_path / 'other_run'))
  assert other.model_proto == first.model_proto
  # Other settings train another: the seed draws the sample.
  config.seed = 1
  assert vocabulary.stored_path(config, sources.load_split(config, 'train')) != stored
  with pytest.raises(AssertionError, match='trained again'):
    data.load_or_train_vocabulary(config, str(tmp_path / 'seed_1'))

  config.seed, config.vocab_size = 0, 400
  with pytest.raises(data.DataError, match='has 320 pieces but config.vocab_size=400'):
    data.load_or_train_vocabulary(config, workdir)
  damaged = tmp_path / 'run' / 'vocab' / 'sentencepiece.model'
  for content in (first.model_proto[:100], b'', None):  # cut; empty; a directory in its place
    if content is None:
      damaged.unlink()
      damaged.mkdir()
    else:
      damaged.write_bytes(content)
    with pytest.raises(data.DataError, match=re.escape(
        f'{damaged} is damaged: SentencePiece cannot read it; restore it from a copy (train.py '
        "keeps one under config.tfds_data_dir's vocabularies/)")):
      data.load_vocabulary(config, workdir)


def test_other_hosts_wait_for_process_0_then_give_up_naming_the_file(tmp_path, monkeypatch):
  monkeypatch.setattr(vocabulary, 'WAIT_SECS', 0.5)
  start = time.time()
  with pytest.raises(data.DataError, match='sentencepiece.model: process 0 did not write'):
    data.load_or_train_vocabulary(tiny.get_config(), str(tmp_path), process_index=1)
  assert time.time() - start >= 0.5 and not os.path.exists(tmp_path / 'vocab')


# Training batches.

def test_ragged_take_gathers_sequences_in_any_order():
  ragged = token_store.Ragged(np.arange(10, 20), np.array([3, 0, 2, 5]))  # [10 11 12] [] ...
  taken = ragged.take(np.array([3, 0, 1, 0, 2]))
  np.testing.assert_array_equal(taken.lengths, [5, 3, 0, 3, 2])
  np.testing.assert_array_equal(taken.flat, [15, 16, 17, 18, 19, 10, 11, 12, 10, 11, 12, 13, 14])
  np.testing.assert_array_equal(taken[4], [13, 14])
  empty = ragged.take(np.zeros(0, np.int64))
  assert empty.flat.size == 0 and empty.lengths.size == 0


def test_a_batch_row_holds_its_pairs_back_to_back(corpus):
  """Row r of device d is the pairs of the shard's row r, their tokens one after another."""
  config, vocab, _ = corpus
  config = with_packing(config, True)
  batches = data.train_batches(config, vocab, num_devices=2)._batches
  rows = batches.rows_per_batch[-1]
  # A batch in which a device has fewer rows than the batch: the rest are all padding.
  length, device_rows = next(b for b in batches.plan(0) if min(map(len, b[1])) < rows)
  batch = batches.fill(length, device_rows)
  for device, (shard, row_ids) in enumerate(zip(batches.shards, device_rows)):
    for row, row_id in enumerate(row_ids.tolist()):
      pairs = shard.rows[row_id].tolist()
      for side, ragged in (('source', shard.encoded.sources), ('target', shard.encoded.targets)):
        expected = np.zeros((3, length), np.int32)  # tokens, segment ids, positions
        ids = np.concatenate([ragged[pair] for pair in pairs])
        expected[:, :len(ids)] = (ids, np.repeat(np.arange(1, len(pairs) + 1),
                                                 [len(ragged[p]) for p in pairs]),
                                  np.concatenate([np.arange(len(ragged[p])) for p in pairs]))
        np.testing.assert_array_equal(
            [batch[f'{side}{suffix}'][device, row] for suffix in
             ('s', '_segment_ids', '_positions')], expected)
    assert not batch['sources'][device, len(row_ids):].any()


def with_packing(config, packing: bool):
  """A copy of `config` batching with or without packing."""
  config = config.copy_and_resolve_references()
  config.packing = packing
  return config


@pytest.mark.parametrize('packing', [False, True])
def test_every_pair_once_per_epoch_with_the_real_token_budget(corpus, packing):
  config, vocab, encoded = corpus
  config = with_packing(config, packing)
  batches = data.train_batches(config, vocab, num_devices=2)
  budget = config.tokens_per_batch // 2  # real tokens per side and device
  buckets = batching.bucket_lengths(config.max_length)
  assert buckets == [8, 16, 24, 32]
  epochs, shapes = [], set()
  for _ in range(2):
    epoch = take(batches, batches.batches_per_epoch)
    row_tokens = collections.defaultdict(lambda: ([], []))  # length -> each side's tokens per row
    for batch in epoch:
      devices, rows, length = batch['sources'].shape
      assert devices == 2 and length in buckets
      assert all(a.shape == batch['sources'].shape and a.dtype == np.int32 for a in batch.values())
      shapes.add(batch['sources'].shape)
      for side, name in zip(row_tokens[length], ('sources', 'targets')):
        real = (batch[name] > 0).sum(-1).ravel()
        side.extend(real[real > 0].tolist())
    # A length has as many batches as its rows need at the budget's rows (the budget over that
    # length's mean real tokens per row, on the side with more), and those batches only as many
    # rows as share them out: the fullest device leaves none empty but in a batch's last row.
    for length in row_tokens:
      batches_of_length = [batch for batch in epoch if batch['sources'].shape[-1] == length]
      rows = batches_of_length[0]['sources'].shape[1]
      budget_rows = budget // max(np.mean(side) for side in row_tokens[length])
      fullest = max(sum(int((batch['sources'][device, :, 0] > 0).sum())
                        for batch in batches_of_length) for device in range(2))
      assert len(batches_of_length) == -(-fullest // budget_rows)
      assert rows == -(-fullest // len(batches_of_length)) <= budget_rows
    epochs.append([pair for batch in epoch for pair in pairs_in(batch)])
    # A device spreads its rows of one length evenly over that length's batches.
    for device in range(2):
      rows = collections.defaultdict(list)  # length -> real rows in each batch of that length
      for batch in epoch:
        sources = batch['sources'][device]
        rows[sources.shape[-1]].append(int((sources[:, 0] > 0).sum()))
      assert all(max(r) - min(r) <= 1 for r in rows.values())
    assert collections.Counter(epochs[-1]) == all_pairs(encoded)
  assert epochs[0] != epochs[1]  # reshuffled
  assert len(shapes) == (1 if packing else len(buckets))
  # On average a batch holds close to the budget (less only where a length's last batches are
  # not full), so the real tokens per update do not depend on how full the rows are.
  assert 0.75 < real_tokens_per_batch(batches) / budget <= 1


def test_too_long_and_empty_pairs_are_dropped_and_counted(tmp_path, corpus):
  config, vocab, encoded = corpus
  sources, targets = data.split_texts(config, 'train')
  longest = [max(len(vocab.encode(s)), len(vocab.encode(t))) + 1 for s, t in zip(sources,
                                                                                    targets)]
  too_long = sum(n > config.max_length for n in longest)
  assert 0 < too_long < len(sources) and encoded.dropped_too_long == too_long
  assert len(encoded) == len(sources) - too_long and encoded.dropped_empty == 0
  assert max(encoded.longest) <= config.max_length

  (tmp_path / 'train.en').write_text('a b\n\nc\n \n')
  (tmp_path / 'train.de').write_text('A B\n\nC\n\n')
  config = config.copy_and_resolve_references()
  config.train_files = str(tmp_path / 'train.{lang}')
  with_empty = encode_all(config, vocab, 'train')
  assert (len(with_empty), with_empty.dropped_empty) == (2, 2)


def test_a_batch_budget_above_what_the_split_holds_is_warned_of(corpus, caplog):
  config, vocab, _ = corpus
  config = config.copy_and_resolve_references()
  for tokens_per_batch, warned in ((10**9, True), (config.tokens_per_batch, False)):
    config.tokens_per_batch = tokens_per_batch
    caplog.clear()
    with caplog.at_level(logging.INFO, logger='absl'):
      batches = data.train_batches(config, vocab, num_devices=2)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (batches.batches_per_epoch <= len(batches._batches.buckets)) == warned
    assert bool([m for m in said if re.fullmatch(
        r'.*: config\.tokens_per_batch=1000000000 is more than the split holds \(the fullest '
        rf"device's share: \d+ real tokens per side\): an epoch is {batches.batches_per_epoch} "
        r'step\(s\), a batch per length; lower tokens_per_batch for more, smaller steps',
        m)]) == warned, said


def test_packed_rows_keep_pairs_separate(corpus):
  config, vocab, _ = corpus
  config = config.copy_and_resolve_references()
  config.packing = True
  batches = data.train_batches(config, vocab, num_devices=2)
  segments_per_row = []
  for batch in take(batches, batches.batches_per_epoch):
    for side in ('source', 'target'):
      tokens = batch[f'{side}s'].reshape(-1, config.max_length)
      segments = batch[f'{side}_segment_ids'].reshape(tokens.shape)
      positions = batch[f'{side}_positions'].reshape(tokens.shape)
      np.testing.assert_array_equal(tokens > 0, segments > 0)
      np.testing.assert_array_equal(positions[segments == 0], 0)
      for row in range(len(tokens)):
        count = segments[row].max()
        # Segments 1..count, contiguous, from the row start, each ending in its only EOS.
        np.testing.assert_array_equal(np.unique(segments[row][segments[row] > 0]),
                                      np.arange(1, count + 1))
        assert np.all(np.diff(segments[row][segments[row] > 0]) >= 0)
        for segment in range(1, count + 1):
          where = segments[row] == segment
          np.testing.assert_array_equal(positions[row][where], np.arange(where.sum()))
          assert list(tokens[row][where]).index(data.EOS_ID) == where.sum() - 1
        if side == 'source':
          segments_per_row.append(count)
          assert count == batch['target_segment_ids'].reshape(tokens.shape)[row].max()
  assert np.mean(segments_per_row) > 1.5  # rows really hold several pairs


@pytest.mark.parametrize('packing', [False, True])
def test_a_restored_position_continues_exactly(corpus, packing):
  config, vocab, _ = corpus
  config = with_packing(config, packing)
  batches = data.train_batches(config, vocab, num_devices=2)
  per_epoch = batches.batches_per_epoch
  expected = take(batches, per_epoch + 6)
  for k in (0, 5, per_epoch - 1, per_epoch + 2):
    resumed = data.train_batches(config, vocab, num_devices=2, start_position=k)
    assert resumed.position == k
    assert_batches_equal(take(resumed, 4)[:len(expected) - k], expected[k:k + 4])
    assert resumed.position == k + 4
  assert batches.position == per_epoch + 6
  # Replaying 10^12 batches would never end: the position is reached directly.
  far = data.train_batches(config, vocab, num_devices=2, start_position=10**12)
  next(far)
  assert far.position == 10**12 + 1


def test_the_seed_decides_the_order(corpus):
  config, vocab, _ = corpus
  same = [take(data.train_batches(config, vocab), 3) for _ in range(2)]
  assert_batches_equal(*same)
  other = config.copy_and_resolve_references()
  other.seed = 1
  assert pairs_in(take(data.train_batches(other, vocab), 1)[0]) != pairs_in(same[0][0])


def corpus_index(encoded) -> dict:
  """(source, target) tokens -> the pair's index in the corpus (the test corpora's pairs differ)."""
  return {(tuple(encoded.sources[k]), tuple(encoded.targets[k])): int(encoded.indices[k])
          for k in range(len(encoded))}


def device_pairs(batch, device: int) -> list:
  return pairs_in({key: value[device] for key, value in batch.items()})


@pytest.mark.parametrize('packing', [False, True])
def test_each_host_takes_its_devices_shards_of_the_same_global_batches(corpus, packing,
                                                                       monkeypatch):
  config, vocab, encoded = corpus
  config = with_packing(config, packing)
  texts_read = []
  monkeypatch.setattr(sources.Corpus, 'texts',
                      lambda self, indices: texts_read.append(self.name))
  hosts = simulated_hosts(lambda i, gather: data.train_batches(
      config, vocab, process_index=i, process_count=2, num_devices=2, all_gather=gather), 2)
  assert not texts_read  # the fixture stored the token ids: no host reads or tokenizes text

  single = data.train_batches(config, vocab, num_devices=4)
  assert {h.batches_per_epoch for h in hosts} == {single.batches_per_epoch}
  index, held = corpus_index(encoded), [set() for _ in range(4)]  # corpus indices per device
  for _ in range(single.batches_per_epoch + 2):
    parts = [next(h) for h in hosts]
    batch = next(single)
    # The same global batch, whichever host a device is on.
    assert_batches_equal([batch], [{key: np.concatenate([p[key] for p in parts])
                                    for key in parts[0]}])
    for device in range(4):
      held[device] |= {index[pair] for pair in device_pairs(batch, device)}
  assert sum(map(len, held)) == len(encoded)  # disjoint shards, the same in every epoch
  for i, host in enumerate(hosts):  # host i holds the pairs of devices 2i and 2i + 1 only
    shards = host._batches.shards  # pylint: disable=protected-access
    assert [set(s.encoded.indices.tolist()) for s in shards] == held[2 * i:2 * i + 2]
  for device in range(4):  # random samples of the corpus, not every 4th line
    assert 0.35 < np.mean([k % 2 for k in held[device]]) < 0.65


def test_no_usable_pair_and_a_wrong_process_count_are_errors(tmp_path, corpus):
  _, vocab, _ = corpus
  config = text_files_config(write_pair(tmp_path, 'train', b'a b c d e f g h\n', b'A B\n'))
  config.max_length = 8
  with pytest.raises(data.DataError, match=r'train.{lang} \(train\): no usable pairs \(0 empty, 1 '
                     r'longer than config.max_length=8\); check the data or raise max_length'):
    data.train_batches(config, vocab)
  with pytest.raises(data.DataError, match='all_gather returned 1 shard rows for 2 devices'):
    data.train_batches(config, vocab, process_index=1, process_count=2)  # JAX runs one process


def test_too_small_a_budget_per_device_is_an_error(corpus):
  config, vocab, _ = corpus
  config = config.copy_and_resolve_references()
  config.grad_accum_steps = 4
  with pytest.raises(data.DataError, match=r'config.tokens_per_batch=512 leaves 16 tokens per '
                     r'device micro-batch .* = 32\), fewer than config.max_length=32'):
    data.train_batches(config, vocab, num_devices=8)


# Evaluation batches and raw text.

@pytest.mark.parametrize('process_count', [1, 2])
@pytest.mark.parametrize('packing', [False, True])
def test_eval_batches_pack_the_split_once_into_one_shape_all_hosts_share(corpus, process_count,
                                                                         packing):
  config, vocab, _ = corpus
  config = config.copy_and_resolve_references()
  config.packing = packing  # training's choice; evaluation packs either way
  hosts = simulated_hosts(lambda i, gather: list(data.eval_batches(
      config, vocab, 'validation', process_index=i, process_count=process_count, num_devices=2,
      all_gather=gather)), process_count)
  assert len({len(h) for h in hosts}) == 1
  batches = [part for host in hosts for part in host]
  assert {b['sources'].shape for b in batches} == {batches[0]['sources'].shape}  # one program
  assert batches[0]['sources'].shape[::2] == (2, config.max_length)
  seen = [p for b in batches for device in range(2) for p in device_pairs(b, device)]
  assert collections.Counter(seen) == all_pairs(encode_all(config, vocab, 'validation'))


def test_a_corpus_keeps_its_last_read():
  """A first run trains the vocabulary on the pairs it then tokenizes: one read of the text."""
  reads = []

  def read(indices):
    reads.append(list(indices))
    return [f's{i}' for i in indices], [f't{i}' for i in indices]

  corpus = sources.Corpus('pairs', 'digest', lambda: (5, read))
  assert corpus.texts(range(5)) == corpus.texts([0, 1, 2, 3, 4]) == (
      ['s0', 's1', 's2', 's3', 's4'], ['t0', 't1', 't2', 't3', 't4'])
  assert corpus.texts([3, 1]) == (['s3', 's1'], ['t3', 't1'])
  assert reads == [[0, 1, 2, 3, 4], [3, 1]]


def test_the_training_split_is_read_once_for_the_vocabulary_and_the_batches(tmp_path,
                                                                           monkeypatch):
  config = text_config(tmp_path, tfds_data_dir=str(tmp_path / 'prepared'))  # nothing stored yet
  corpus = data.load_split(config, 'train')
  reads = []
  size, read = corpus._open()
  monkeypatch.setattr(corpus, '_open', lambda: (size, lambda i: reads.append(1) or read(i)))
  vocab = data.load_or_train_vocabulary(config, str(tmp_path / 'workdir'), corpus=corpus)
  batches = data.train_batches(config, vocab, corpus=corpus)
  assert len(reads) == 1 and next(batches)['sources'].any()


def test_split_texts_are_the_raw_pairs_in_order(corpus):
  config, _, _ = corpus
  sources, references = data.split_texts(config, 'validation')
  assert len(sources) == 90 and references == [s.upper() for s in sources]
  english = pathlib.Path(config.validation_files.replace('{lang}', 'en'))
  assert sources[0] == english.read_text().split('\n')[0].rstrip()


# The configs' datasets.

def test_tiny_config_on_synthetic_data(tmp_path):
  config = config_lib.validate(tiny.get_config())
  vocab = data.load_or_train_vocabulary(config, str(tmp_path))
  batches = data.train_batches(config, vocab, num_devices=4)
  # 256 real tokens per device and side, less only where a length's last batch is not full.
  assert 0.8 < real_tokens_per_batch(batches) / 256 <= 1
  sources, targets = data.split_texts(config, 'train')
  assert (len(sources), len(data.split_texts(config, 'validation')[0])) == (2000, 200)
  words, translations = synthetic._lexicon()  # pylint: disable=protected-access
  mapping = dict(zip(words, translations))
  assert targets[0].split() == [mapping[w] for w in reversed(sources[0].split())]
  encoded = encode_all(config, vocab, 'train')
  assert len(encoded) + encoded.dropped_too_long == 2000 and encoded.dropped_too_long < 20


def test_tfds_translation_dataset_end_to_end_with_mock_data(tmp_path):
  config = default.get_config()
  config.update(vocab_size=320, max_length=32, tokens_per_batch=256, vocab_sample_size=200)
  config_lib.validate(config)
  with tfds.testing.mock_data(num_examples=120):
    sources, references = data.split_texts(config, 'validation')
    mocked = tfds.data_source('wmt14_translate/de-en', split='validation')
    assert sources == [mocked[i]['en'] for i in range(120)]
    assert references == [mocked[i]['de'] for i in range(120)]
    vocab = data.load_or_train_vocabulary(config, str(tmp_path))
    batches = data.train_batches(config, vocab, num_devices=2)
    batch = next(batches)
    devices, rows, length = batch['sources'].shape
    assert devices == 2 and length <= 32
    assert 0.75 < real_tokens_per_batch(batches) / 128 <= 1
    assert set(batch) == {'sources', 'targets'}
    encoded = encode_all(config, vocab, 'validation')
    evaluated = [p for b in data.eval_batches(config, vocab, 'validation', num_devices=2)
                 for p in pairs_in(b)]
    assert len(evaluated) == len(encoded) > 0
    config.source_lang = 'fr'
    with pytest.raises(data.DataError, match="has no language 'fr'"):
      data.split_texts(config, 'test')


@pytest.mark.slow
def test_multi30k_from_a_local_directory(multi30k_dir, tmp_path):
  config = multi30k.get_config()
  config.update(manual_dir=multi30k_dir, tfds_data_dir=str(tmp_path))
  config_lib.validate(config)
  sizes = {split: len(data.split_texts(config, split)[0])
           for split in ('train', 'validation', 'test')}
  assert sizes == {'train': 29000, 'validation': 1014, 'test': 1000}
  sources, references = data.split_texts(config, 'test')
  with gzip.open(os.path.join(multi30k_dir, 'test_2016_flickr.de.gz'), 'rt') as f:
    assert references[:3] == [f.readline().rstrip('\n') for _ in range(3)]
  config.target_lang = 'fr'
  _, french = data.split_texts(config, 'validation')
  with gzip.open(os.path.join(multi30k_dir, 'val.fr.gz'), 'rt') as f:
    assert len(french) == 1014 and french[-1] == f.read().rstrip('\n').split('\n')[-1]


def write_lines(path, lines: list[str]):
  with gzip.open(path, 'wt', encoding='utf-8') as f:
    f.write(''.join(f'{line}\n' for line in lines))


def fake_multi30k(directory) -> str:
  """The nine Multi30k files, three lines each ('train de 0', ...)."""
  os.makedirs(directory)
  for name in multi30k_files.FILE_NAMES:
    prefix, lang, _ = name.split('.')
    write_lines(os.path.join(directory, name), [f'{prefix} {lang} {i}' for i in range(3)])
  return str(directory)


def test_multi30k_is_prepared_anew_when_its_files_change(tmp_path, caplog):
  config = multi30k.get_config()
  config.update(manual_dir=fake_multi30k(tmp_path / 'a'), tfds_data_dir=str(tmp_path / 'tfds'))
  original = ['train de 0', 'train de 1', 'train de 2']
  with caplog.at_level(logging.INFO, logger='absl'):
    assert data.split_texts(config, 'train')[1] == original
  said = [r.getMessage() for r in caplog.records]
  assert any(m.startswith(f'preparing multi30k from {tmp_path / "a"} (files sha256 ') for m in said)
  assert any(re.fullmatch(r'prepared multi30k in [\d.]+ s', m) for m in said), said
  changed = shutil.copytree(tmp_path / 'a', tmp_path / 'b')
  write_lines(changed / 'train.de.gz', ['train de 0', 'geändert', 'train de 2'])
  config.manual_dir = str(changed)
  assert data.split_texts(config, 'train')[1] == ['train de 0', 'geändert', 'train de 2']

  shorter = shutil.copytree(tmp_path / 'a', tmp_path / 'c')
  write_lines(shorter / 'train.de.gz', original[:2])
  config.manual_dir = str(shorter)
  with pytest.raises(data.DataError, match=rf'^{shorter}/train.en.gz has 3 lines but '
                                           rf'{shorter}/train.de.gz has 2'):
    data.split_texts(config, 'train')
  broken = shutil.copytree(tmp_path / 'a', tmp_path / 'd')
  with gzip.open(broken / 'train.de.gz', 'wb') as f:
    f.write(b'train de 0\n\xff\ntrain de 2\n')
  config.manual_dir = str(broken)
  with pytest.raises(data.DataError, match=rf'^{broken}/train.de.gz:2: invalid UTF-8'):
    data.split_texts(config, 'train')
  os.remove(broken / 'val.fr.gz')
  with pytest.raises(data.DataError, match=rf'^{broken}/val.fr.gz: no such file; '
                                           'config.manual_dir must hold all of'):
    data.split_texts(config, 'train')

  config.manual_dir = str(tmp_path / 'a')  # its own data, prepared earlier
  caplog.clear()
  with caplog.at_level(logging.INFO, logger='absl'):
    assert data.split_texts(config, 'train')[1] == original
  assert not any(r.getMessage().startswith('prepar') for r in caplog.records)


def test_downloaded_multi30k_is_prepared_anew_when_the_download_changes(tmp_path, monkeypatch):
  served = [fake_multi30k(tmp_path / 'first')]  # what the URLs give, as local files
  monkeypatch.setattr(tfds.download.DownloadManager, 'download', lambda self, urls: {
      name: os.path.join(served[0], url.rsplit('/', 1)[1]) for name, url in urls.items()})
  config = multi30k.get_config()
  config.update(manual_dir='', tfds_data_dir=str(tmp_path / 'tfds'))
  assert data.split_texts(config, 'test')[0][0] == 'test_2016_flickr en 0'
  served[0] = str(shutil.copytree(tmp_path / 'first', tmp_path / 'second'))
  write_lines(tmp_path / 'second' / 'test_2016_flickr.en.gz', ['new', 'text', 'here'])
  assert data.split_texts(config, 'test')[0] == ['new', 'text', 'here']


# Bad input: one DataError naming the file (and line) and the fix.

def write_pair(directory, name, source: bytes, target: bytes, compress=False):
  for lang, content in (('en', source), ('de', target)):
    path = os.path.join(directory, f'{name}.{lang}' + ('.gz' if compress else ''))
    with (gzip.open if compress else open)(path, 'wb') as f:
      f.write(content)
  return os.path.join(directory, f'{name}.{{lang}}' + ('.gz' if compress else ''))


def text_files_config(pattern):
  config = default.get_config()
  config.update(dataset='text', train_files=pattern)
  return config_lib.validate(config)


@pytest.mark.parametrize('source, target, message', [
    (b'a\nb\nc\n', b'A\nB\n', r'train.en.gz has 3 lines but .*train.de.gz has 2'),
    (b'a\nb\n\xff\xfe\n', b'A\nB\nC\n', r'train.en.gz:3: invalid UTF-8'),
    (b'a\nb\nc\n', b'A\n\nC\n', r'train.de.gz:2: empty line, but line 2 of .*train.en.gz is not'),
])
def test_bad_text_files(tmp_path, source, target, message):
  config = text_files_config(write_pair(tmp_path, 'train', source, target, compress=True))
  with pytest.raises(data.DataError, match=message):
    data.split_texts(config, 'train')


@pytest.mark.slow
def test_training_files_of_empty_lines_are_said_to_hold_no_sentence(tmp_path):
  pattern = write_pair(tmp_path, 'train', b'\n\n\n', b'\n\n\n')
  result = run_script('train.py', '--config=configs/tiny.py', f'--workdir={tmp_path}/run',
                      '--config.dataset=text', f'--config.train_files={pattern}',
                      f'--config.tfds_data_dir={tmp_path}/tfds')
  assert error_line(result) == (f'train.py: {pattern} (train) holds no sentence (3 pairs, every '
                                'line empty or blank): give files with text')
  # No vocab/ and no checkpoints/: the next run starts afresh.
  assert sorted(os.listdir(tmp_path / 'run')) == ['config.json', 'run.lock']


def test_missing_files_and_directories_and_unknown_datasets(tmp_path):
  config = text_files_config(write_pair(tmp_path, 'train', b'a\n', b'A\n'))
  os.remove(tmp_path / 'train.de')
  with pytest.raises(data.DataError, match=r'train.de: no such file'):
    data.split_texts(config, 'train')
  with pytest.raises(data.DataError, match=r'config.validation_files is empty'):
    data.split_texts(config, 'validation')

  config = multi30k.get_config()
  config.update(manual_dir=str(tmp_path / 'absent'), tfds_data_dir=str(tmp_path / 'tfds'))
  with pytest.raises(data.DataError, match=r"config.manual_dir='.*absent': no such directory"):
    data.split_texts(config, 'test')

  config = default.get_config()
  config.tfds_data_dir = str(tmp_path / 'tfds')
  for dataset, message in (
      ('no_such_dataset/de-en', 'no such TFDS dataset; use '),
      ('wmt14_translate/de-em', "wmt14_translate has no config 'de-em'; use one of "
                                "'wmt14_translate/cs-en', 'wmt14_translate/de-en', "),
      ('wmt14_translate/de-en:9.9.9', 'Dataset wmt14_translate cannot be loaded at version 9.9.9, '
                                      'only: 1.0.0.'),
      ('wmt14_translate/de-en:last', 'not a TFDS name (NAME/CONFIG[:VERSION]); use ')):
    config.dataset = dataset
    with pytest.raises(data.DataError) as error:
      data.split_texts(config, 'train')
    assert str(error.value).startswith(f'config.dataset={dataset!r}: {message}')
  assert os.listdir(config.tfds_data_dir) == []  # nothing downloaded or prepared


def test_bad_multi30k_directory_names_the_file(tmp_path):
  for name in ('train', 'val', 'test_2016_flickr'):
    for lang in ('en', 'de', 'fr'):
      with gzip.open(tmp_path / f'{name}.{lang}.gz', 'wt') as f:
        f.write('a\nb\n' if (name, lang) != ('val', 'fr') else 'a\n')
  config = multi30k.get_config()
  config.update(manual_dir=str(tmp_path), tfds_data_dir=str(tmp_path / 'tfds'))
  with pytest.raises(data.DataError, match=r'val.en.gz has 2 lines but .*val.fr.gz has 1'):
    data.split_texts(config, 'train')


@pytest.mark.parametrize('key, value, message', [
    ('vocab_sample_size', 0, 'must be an integer >= 1'),
    ('train_files', 'data/train.gz', "must contain '{lang}'"),
    ('dataset', 'text', "dataset='text' reads its training pairs from these files"),
])
def test_config_checks_the_data_keys(key, value, message):
  config = default.get_config()
  config[key] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config)



TOKENIZE = """
import hashlib, json, sys
import ml_collections
from transformer import data
from transformer.data import sources, token_store
config = ml_collections.ConfigDict(json.loads(sys.argv[1]))
vocab = data.load_or_train_vocabulary(config, sys.argv[2])
tokenized = token_store.load_or_tokenize(config, sources.load_split(config, 'train'), vocab)
ids = tokenized.sources.flat.tobytes() + tokenized.targets.flat.tobytes()
print(hashlib.sha256(ids).hexdigest())
"""


@pytest.mark.slow
def test_two_processes_store_one_split_alike_and_never_replace_a_file(tmp_path):
  """Two hosts that find no store tokenize at once: both get the same ids and one complete store;
  a file already written is never replaced (another host may have it mapped into memory)."""
  config = text_config(tmp_path, tfds_data_dir=str(tmp_path / 'tfds'))
  workdir = str(tmp_path / 'workdir')
  vocab = data.load_or_train_vocabulary(config, workdir)
  hosts = [subprocess.Popen([sys.executable, '-c', TOKENIZE, config.to_json(), workdir],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
  digests = []
  for host in hosts:
    out, err = host.communicate(timeout=300)
    assert host.returncode == 0, err[-3000:]
    digests.append(out.split()[-1])
  assert digests[0] == digests[1]
  directory = pathlib.Path(token_store.store_dir(config, sources.load_split(config, 'train'),
                                                 vocab))
  files = sorted(path.name for path in directory.iterdir())
  assert files == ['info.json'] + sorted(f'{side}_{name}.npy' for side in token_store.SIDES
                                         for name in ('lengths', 'tokens'))
  # A host that started before the store was complete writes only what is missing.
  identity = lambda path: (path.stat().st_ino, path.stat().st_mtime_ns)
  arrays = {path: identity(path) for path in directory.glob('*.npy')}
  missing = directory / f'{token_store.SIDES[0]}_tokens.npy'
  (directory / 'info.json').unlink()
  missing.unlink()
  token_store.load_or_tokenize(config, sources.load_split(config, 'train'), vocab)
  assert missing.exists() and all(identity(path) == before for path, before in arrays.items()
                                  if path != missing)
  assert (directory / 'info.json').exists()


@pytest.mark.parametrize('damage', ['cut', 'corrupt'])
def test_a_damaged_gzip_file_is_named_with_the_fix(tmp_path, damage):
  whole = gzip.compress(b''.join(b'sentence %d\n' % i for i in range(2000)))
  middle = len(whole) // 2
  damaged = (whole[:middle] if damage == 'cut' else
             whole[:middle] + bytes(b ^ 0xff for b in whole[middle:middle + 64]) +
             whole[middle + 64:])
  path = tmp_path / 'train.en.gz'
  path.write_bytes(damaged)
  with pytest.raises(data.DataError, match=re.escape(f'{path}: not a whole gzip file (') +
                     r'.*\); download or copy it again$'):
    data.read_lines(str(path))
  path.write_bytes(codecs.BOM_UTF8 + b'Ein Mann.\n')  # a byte-order mark is not the first word's
  assert data.read_lines(str(path)) == ['Ein Mann.']


def test_a_cut_multi30k_file_is_named_through_tfds_and_nothing_is_prepared(multi30k_dir,
                                                                           tmp_path):
  manual_dir = tmp_path / 'multi30k'
  shutil.copytree(multi30k_dir, manual_dir)
  whole = (manual_dir / 'val.de.gz').read_bytes()
  (manual_dir / 'val.de.gz').write_bytes(whole[:len(whole) // 2])
  config = multi30k.get_config('en-de')
  config.update(manual_dir=str(manual_dir), tfds_data_dir=str(tmp_path / 'tfds'))
  with pytest.raises(data.DataError, match=re.escape(
      f'{manual_dir}/val.de.gz: not a whole gzip file (Compressed file ended before the '
      'end-of-stream marker was reached); download or copy it again')):
    data.load_split(config, 'train')
  prepared = tmp_path / 'tfds' / 'multi30k_sources'
  assert [path for path in prepared.rglob('*.array_record*')] == []  # no half a dataset
