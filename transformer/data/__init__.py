"""The input pipeline: text sources, the SentencePiece vocabulary and token batches.

Token ids: PAD_ID=0 (padding; also the decoder's start symbol), EOS_ID=1 (appended to every
sentence), UNK_ID=2; no beginning-of-sentence id. Batches are dicts of int32 arrays
[num_devices, rows, length] named like the arguments of `Transformer.__call__`:
'sources', 'targets' and, with config.packing, 'source_segment_ids', 'source_positions',
'target_segment_ids', 'target_positions'.

  corpus = load_split(config, 'train')  # optional: its text is read once for both below
  vocab = load_or_train_vocabulary(config, workdir, corpus=corpus)
  # Every host at once (they all-gather their shard sizes); each reads only its devices' shards.
  batches = train_batches(config, vocab, process_index, process_count, num_devices, start_position,
                          corpus=corpus)
  next(batches); batches.position  # batches yielded so far: restart from it with start_position
  for batch in eval_batches(config, vocab, 'validation', ...): ...
  sources, references = split_texts(config, 'test')
  # A multilingual config (config.pairs): every pair's at once, each source starting with its
  # target language's tag (languages.tag('de') = '<2de>'), or one pair's.
  sources, references = split_texts(config, 'test', pair=('en', 'fr'))
  sentences = read_lines(path)  # a UTF-8 file, gzipped or not; bad lines named in a DataError
  sentences = tagged('<2fr>', sentences)  # for a multilingual model to translate into French
"""

from transformer.data.batching import eval_batches, train_batches
from transformer.data.errors import DataError
from transformer.data.sources import load_split, split_texts, tagged
from transformer.data.text_files import decode_lines, read_lines
from transformer.data.vocabulary import (EOS_ID, PAD_ID, UNK_ID, Vocabulary,
                                         load_or_train_vocabulary, load_vocabulary,
                                         marian_vocabulary)

__all__ = ['EOS_ID', 'PAD_ID', 'UNK_ID', 'DataError', 'Vocabulary', 'decode_lines',
           'eval_batches', 'load_or_train_vocabulary', 'load_split',
           'load_vocabulary', 'marian_vocabulary', 'read_lines', 'split_texts', 'tagged',
           'train_batches']
