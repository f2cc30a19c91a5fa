"""A small generated parallel corpus: learnable in seconds, for tests and quick checks.

A source sentence is 2-7 words drawn, Zipf-distributed, from 32 fixed words over the letters a-h;
its translation maps each word through a fixed permutation of them and reverses the word order.
The corpus is a fixed function of the split (config.seed only shuffles batches).
"""

import numpy as np

SPLIT_SIZES = {'train': 2000, 'validation': 200, 'test': 200}
_SPLIT_SEEDS = {'train': 1, 'validation': 2, 'test': 3}
_ZIPF = 1 / np.arange(1, 33) / np.sum(1 / np.arange(1, 33))  # word frequencies as in real text


def _lexicon() -> tuple[list[str], list[str]]:
  rng = np.random.default_rng(0)
  words = set()
  while len(words) < 32:
    words.add(''.join(rng.choice(list('abcdefgh'), rng.integers(2, 5))))
  words = sorted(words)
  return words, [words[i] for i in rng.permutation(len(words))]


def pairs(split: str) -> tuple[list[str], list[str]]:
  """(sources, targets) of `split`: 'train', 'validation' or 'test'."""
  words, translations = _lexicon()
  rng = np.random.default_rng(_SPLIT_SEEDS[split])
  sources, targets = [], []
  for _ in range(SPLIT_SIZES[split]):
    sentence = rng.choice(len(words), rng.integers(2, 8), p=_ZIPF)
    sources.append(' '.join(words[i] for i in sentence))
    targets.append(' '.join(translations[i] for i in sentence[::-1]))
  return sources, targets
