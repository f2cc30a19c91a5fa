"""Everything a config's training reads, prepared once: the dataset, the vocabulary, the token ids
of every split; train.py then finds each where this put it (sources.prepared_dir)."""

import time

import ml_collections
from absl import logging

from transformer.data import sources, token_store, vocabulary


def splits(config: ml_collections.ConfigDict) -> list[str]:
  """The splits config's dataset has: dataset='text' has those whose files are named."""
  if config.dataset == 'text':
    return [split for split in sources.SPLITS if config[f'{split}_files']]
  return list(sources.SPLITS)


def prepare(config: ml_collections.ConfigDict) -> list[str]:
  """Prepares config's data (each part only if it is not there yet); one summary line per part.

  Raises:
    DataError: the data cannot be read or downloaded; the message says what to do.
  """
  began = time.time()
  train = sources.load_split(config, 'train')  # a TFDS dataset is downloaded and prepared here
  vocab = vocabulary.Vocabulary(vocabulary.load_or_train_model(config, train))
  summary = [f'vocabulary ({config.vocab_size} pieces): {vocabulary.stored_path(config, train)}']
  for split in splits(config):
    corpus = train if split == 'train' else sources.load_split(config, split)
    tokenized = token_store.load_or_tokenize(config, corpus, vocab)
    tokens = tokenized.sources.lengths.sum() + tokenized.targets.lengths.sum()
    summary.append(f'{corpus.name}: {len(tokenized):,} pairs, {tokens:,} tokens: '
                   f'{token_store.store_dir(config, corpus, vocab)}')
  logging.info('prepared in %.1f s', time.time() - began)
  return summary
