"""Each split tokenized once per (source data, vocabulary), stored beside the prepared data, and
read back by every later run, host and resume.

A split's store is `<prepared dir>/tokens/<key>/` (sources.prepared_dir): for each side, the
token ids of all pairs in corpus order, each pair's ending in EOS, concatenated
(`{side}_tokens.npy`: uint16 where the vocabulary fits, else int32), and each pair's length
(`{side}_lengths.npy`); `info.json`, written last, marks it complete. The key hashes the corpus's
digest and the vocabulary's model, so a changed source or vocabulary is tokenized anew and never
read from an earlier store. Written by hand: the store is two flat arrays per side that numpy
memory-maps, which the batcher gathers per shard with no per-pair Python.
"""

import dataclasses
import hashlib
import io
import itertools
import json
import os
import time

import numpy as np
from absl import logging
from etils import epath

from transformer.data import sources
from transformer.data.vocabulary import Vocabulary
from transformer.files import is_remote, open_atomically, write_atomically

CHUNK = 100_000  # pairs read and tokenized at a time
SIDES = ('source', 'target')


class Ragged:
  """Sequences of different lengths, stored flat: `ragged[i]` is sequence i."""

  def __init__(self, flat: np.ndarray, lengths: np.ndarray):
    self.flat, self.lengths = flat, lengths
    self.offsets = np.concatenate([[0], np.cumsum(lengths)])

  def __getitem__(self, i: int) -> np.ndarray:
    return self.flat[self.offsets[i]:self.offsets[i + 1]]

  def take(self, indices: np.ndarray) -> 'Ragged':
    """The sequences at `indices`, in that order, copied out in one vectorised gather."""
    lengths = np.asarray(self.lengths[indices])
    starts = np.cumsum(lengths) - lengths  # where each lands in the result
    positions = (np.arange(int(lengths.sum())) +
                 np.repeat(self.offsets[indices] - starts, lengths))
    return Ragged(np.asarray(self.flat[positions]), lengths)


@dataclasses.dataclass
class Tokenized:
  """All pairs of a split as token ids, EOS included; an empty side is just [EOS]."""

  name: str
  sources: Ragged
  targets: Ragged

  def __len__(self) -> int:
    return len(self.sources.lengths)


def token_dtype(vocab_size: int) -> type:
  return np.uint16 if vocab_size <= 2**16 else np.int32


def store_dir(config, corpus: sources.Corpus, vocab: Vocabulary) -> str:
  """Where `corpus`'s token ids under `vocab` are stored."""
  key = sources.digest(corpus.digest, hashlib.sha256(vocab.model_proto).hexdigest())
  return os.path.join(sources.prepared_dir(config), 'tokens', key[:16])


def tokenize(corpus: sources.Corpus, vocab: Vocabulary) -> Tokenized:
  """Every pair of `corpus` as token ids (ids of a chunk of pairs at a time, on all CPU cores),
  logging its progress."""
  dtype = token_dtype(vocab.vocab_size)
  pieces = {side: ([], []) for side in SIDES}  # side -> (token chunks, length chunks)
  began, logged = time.time(), 0
  for start in range(0, len(corpus), CHUNK):
    texts = corpus.texts(range(start, min(start + CHUNK, len(corpus))))
    for side, side_texts in zip(SIDES, texts):
      ids = vocab.encode_batch(side_texts, add_eos=True, side=side)
      lengths = np.fromiter(map(len, ids), np.int32, len(ids))
      tokens, chunk_lengths = pieces[side]
      tokens.append(np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum())))
      chunk_lengths.append(lengths)
    done = min(start + CHUNK, len(corpus))
    if len(corpus) > CHUNK and 10 * done // len(corpus) > logged:
      logged = 10 * done // len(corpus)
      secs = time.time() - began
      logging.info('%s: tokenized %d/%d pairs in %.0f s (%.0f pairs/s)', corpus.name, done,
                   len(corpus), secs, done / max(secs, 1e-9))
  return Tokenized(corpus.name, *(
      Ragged(np.concatenate([np.zeros(0, dtype), *tokens]),
             np.concatenate([np.zeros(0, np.int32), *lengths]))
      for tokens, lengths in pieces.values()))


def _save(path: str, array: np.ndarray):
  with open_atomically(path) as f:
    np.save(f, array)


def load_array(path: str) -> np.ndarray:
  if is_remote(path):
    return np.load(io.BytesIO(epath.Path(path).read_bytes()))
  return np.load(path, mmap_mode='r')  # pages are read as the shards gather them


def load_or_tokenize(config, corpus: sources.Corpus, vocab: Vocabulary) -> Tokenized:
  """`corpus`'s token ids: read from its store, or tokenized and stored there first.

  Hosts that find no store each tokenize and write it. Each file is written whole
  (`open_atomically`), and only where it is missing: the store is keyed by its corpus and
  vocabulary, so a file another host wrote holds the same bytes, and a file that a host has
  mapped into memory is never replaced under it.
  """
  directory = store_dir(config, corpus, vocab)
  info = os.path.join(directory, 'info.json')
  if epath.Path(info).exists():
    logging.info('%s: token ids read from %s', corpus.name, directory)
    return Tokenized(corpus.name, *(
        Ragged(load_array(os.path.join(directory, f'{side}_tokens.npy')),
               load_array(os.path.join(directory, f'{side}_lengths.npy'))) for side in SIDES))
  began = time.time()
  tokenized = tokenize(corpus, vocab)
  with sources.writing_prepared(config):
    for side, ragged in zip(SIDES, (tokenized.sources, tokenized.targets)):
      for name, array in (('tokens', ragged.flat), ('lengths', ragged.lengths)):
        path = os.path.join(directory, f'{side}_{name}.npy')
        if not epath.Path(path).exists():
          _save(path, array)
    if epath.Path(info).exists():  # another host finished first
      return tokenized
    size = sum(r.flat.nbytes + r.lengths.nbytes for r in (tokenized.sources, tokenized.targets))
    write_atomically(info, json.dumps({
        'corpus': corpus.name, 'corpus_digest': corpus.digest, 'pairs': len(tokenized),
        'tokens': [int(r.flat.size) for r in (tokenized.sources, tokenized.targets)],
        'bytes': size, 'seconds': round(time.time() - began, 1)}, indent=2))
  logging.info('%s: %d pairs tokenized in %.1f s, stored in %s (%.0f MiB)', corpus.name,
               len(tokenized), time.time() - began, directory, size / 2**20)
  return tokenized
