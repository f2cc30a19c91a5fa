"""The joint source-target SentencePiece vocabulary: trained once per training data and settings,
kept beside the prepared data, and copied into each run's workdir.

Fixed ids: PAD_ID=0 (padding, and the decoder's start symbol), EOS_ID=1 (ends every sentence),
UNK_ID=2; there is no beginning-of-sentence id. The text is kept as written (no NFKC rewriting), and
characters the training text lacks are spelled as UTF-8 bytes (256 byte pieces), so decoding gives
back any input exactly, never the unknown symbol.
"""

import io
import json
import os
import time

import jax
import ml_collections
import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2
from absl import logging
from etils import epath

from transformer import languages, marian
from transformer.data import sources
from transformer.data.errors import DataError
from transformer.files import write_atomically

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
MODEL_FILE = os.path.join('vocab', 'sentencepiece.model')
# A vocabulary imported from a Marian model (`MarianVocabulary`): its last file marks it whole.
MARIAN_FILES = ('source.spm', 'target.spm', 'pieces.json')
MARIAN_FILE = os.path.join('vocab', MARIAN_FILES[-1])
WAIT_SECS = 4 * 3600  # other hosts wait this long for process 0 to train the vocabulary


class Vocabulary:
  """Text <-> token ids; `encode` adds no EOS, `decode` stops at the first EOS and skips padding.

  One SentencePiece model for both sides; `model_proto` identifies the vocabulary.
  """

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    self._processor = spm.SentencePieceProcessor(model_proto=model_proto)
    # Tags (config.pairs' target languages): SentencePiece spells a word-start '▁' alone before
    # one, which `encode_batch` leaves out: the model reads the tag, then the sentence.
    self.tags = {piece.piece: i for i, piece in enumerate(
        sentencepiece_model_pb2.ModelProto.FromString(model_proto).pieces)
                 if piece.type == sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED}
    self._tag_ids = frozenset(self.tags.values())
    self._space = self._processor.piece_to_id('▁') if self.tags else None

  @property
  def vocab_size(self) -> int:
    return self._processor.get_piece_size()

  def files(self) -> dict[str, bytes]:
    """What `write` puts in a workdir's vocab/, by name."""
    return {os.path.basename(MODEL_FILE): self.model_proto}

  def sentencepiece_models(self) -> tuple[bytes, bytes]:
    """The SentencePiece model protos of the source and the target side."""
    return self.model_proto, self.model_proto

  def encode(self, text: str) -> list[int]:
    return self.encode_batch([text])[0]

  def encode_batch(self, texts: list[str], add_eos: bool = False,
                   side: str = 'source') -> list[list[int]]:
    """The ids of each text of `side` ('source' or 'target'), EOS added if `add_eos`."""
    del side  # one model for both
    encoded = self._processor.encode(texts, add_eos=add_eos, num_threads=os.cpu_count())
    if not self._tag_ids:
      return encoded
    return [[i for i, following in zip(ids, ids[1:] + [None])
             if not (i == self._space and following in self._tag_ids)] for ids in encoded]

  def pieces(self, ids) -> list[str]:
    """The SentencePiece piece of each id ('▁' marks a word start; '<0xC3>' is a byte)."""
    return [self._processor.id_to_piece(int(i)) for i in ids]

  def piece_ids(self, pieces: list[str]) -> list[int]:
    """`pieces`' inverse: the id of each piece (UNK_ID for one the vocabulary lacks)."""
    return [self._processor.piece_to_id(piece) for piece in pieces]

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids]
    if EOS_ID in ids:
      ids = ids[:ids.index(EOS_ID)]
    return self._processor.decode([i for i in ids if i != PAD_ID])


class MarianVocabulary(Vocabulary):
  """The vocabulary of a model imported from Marian (transformer/marian.py): source text split
  by the source SentencePiece model, targets by the target one, and each piece's id its place in
  `pieces` (our order: pad, EOS, unk, then Marian's). As MarianTokenizer, a piece not in `pieces`
  is unk, and decoding leaves the special pieces out.
  """

  def __init__(self, source_proto: bytes, target_proto: bytes, pieces: list[str]):
    self.pieces_json = json.dumps(pieces, ensure_ascii=False).encode('utf-8')
    super().__init__(target_proto)
    self.tags = {}  # as MarianTokenizer, pieces only
    self.model_proto = source_proto + target_proto + self.pieces_json  # identifies it
    self._source_proto, self._target_proto = source_proto, target_proto
    self._source = spm.SentencePieceProcessor(model_proto=source_proto)
    self._pieces = list(pieces)
    self._ids = {piece: i for i, piece in enumerate(pieces)}

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)

  def files(self) -> dict[str, bytes]:
    return dict(zip(MARIAN_FILES, (self._source_proto, self._target_proto, self.pieces_json)))

  def sentencepiece_models(self) -> tuple[bytes, bytes]:
    return self._source_proto, self._target_proto

  def encode(self, text: str) -> list[int]:
    return self.encode_batch([text])[0]

  def encode_batch(self, texts: list[str], add_eos: bool = False,
                   side: str = 'source') -> list[list[int]]:
    processor = self._source if side == 'source' else self._processor
    eos = [EOS_ID] if add_eos else []
    return [[self._ids.get(piece, UNK_ID) for piece in pieces] + eos
            for pieces in processor.encode(texts, out_type=str, num_threads=os.cpu_count())]

  def pieces(self, ids) -> list[str]:
    return [self._pieces[int(i)] for i in ids]

  def piece_ids(self, pieces: list[str]) -> list[int]:
    return [self._ids.get(piece, UNK_ID) for piece in pieces]

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids]
    if EOS_ID in ids:
      ids = ids[:ids.index(EOS_ID)]
    return self._processor.decode_pieces(
        [self._pieces[i] for i in ids if i not in (PAD_ID, UNK_ID)]).strip()


def marian_vocabulary(directory: str) -> MarianVocabulary:
  """The vocabulary of a Hugging Face Marian directory: source.spm, target.spm and vocab.json
  (MarianTokenizer's files), in the token order `marian.token_order` gives its config.json.

  Raises:
    DataError: a file is missing or unreadable, or the directory's tokenizer is one this model
      cannot take (separate source and target vocabularies); the message names it.
  """
  def read(name: str) -> bytes:
    try:
      return epath.Path(directory, name).read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
      raise DataError(f'{os.path.join(directory, name)} not found: a Marian directory holds '
                      'config.json, source.spm, target.spm and vocab.json') from None

  try:
    config = json.loads(read('config.json'))
    vocab = json.loads(read('vocab.json'))
    tokenizer = (json.loads(read('tokenizer_config.json'))
                 if epath.Path(directory, 'tokenizer_config.json').exists() else {})
    if tokenizer.get('separate_vocabs'):
      raise marian.MarianError('tokenizer_config.json: "separate_vocabs" is true: this model has '
                               'one vocabulary for both sides')
    order = marian.token_order(config, vocab)
  except ValueError as error:  # JSON's and MarianError
    raise DataError(f'{directory}: {error}') from None
  piece_of = {i: piece for piece, i in vocab.items()}
  missing = [int(i) for i in order if int(i) not in piece_of]
  if missing:
    raise DataError(f'{directory}/vocab.json has no piece for id {missing[0]} (of '
                    f'"vocab_size"={config["vocab_size"]} in config.json)')
  try:
    return MarianVocabulary(read('source.spm'), read('target.spm'),
                            [piece_of[int(i)] for i in order])
  except RuntimeError:  # SentencePiece's parse error
    raise DataError(f'{directory}: source.spm or target.spm is not a SentencePiece model') from None


def write(vocab: Vocabulary, workdir: str):
  """Puts `vocab`'s files in `<workdir>/vocab/`, the one that marks it whole last."""
  for name, content in vocab.files().items():
    write_atomically(os.path.join(workdir, 'vocab', name), content)


def train_model(config: ml_collections.ConfigDict, corpus: sources.Corpus) -> bytes:
  """A SentencePiece model proto trained on both sides of up to vocab_sample_size pairs of the
  training `corpus`."""
  size = min(len(corpus), config.vocab_sample_size)
  indices = np.sort(np.random.default_rng(config.seed).choice(len(corpus), size, replace=False))
  source_texts, target_texts = corpus.texts(indices.tolist())
  sentences = [s for pair in zip(source_texts, target_texts) for s in pair if s.strip()]
  if not sentences:
    raise DataError(f'{corpus.name} holds no sentence ({len(corpus)} pairs, every line empty or '
                    'blank): give files with text')
  tags = tag_pieces(config)
  logging.info('training a %d-piece %s vocabulary on %d sentences of %s%s', config.vocab_size,
               config.vocab_model_type, len(sentences), corpus.name,
               f' with the tags {", ".join(tags)}' if tags else '')
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=config.vocab_size,
        model_type=config.vocab_model_type, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID,
        bos_id=-1, byte_fallback=True, normalization_rule_name='identity',
        user_defined_symbols=tags,
        num_threads=os.cpu_count(), minloglevel=2)
  except RuntimeError as error:
    raise DataError(f'config.vocab_size={config.vocab_size}: SentencePiece cannot build it from '
                    f'{corpus.name} ({error}); change config.vocab_size as it says') from None
  return model.getvalue()


def stored_path(config: ml_collections.ConfigDict, corpus: sources.Corpus) -> str:
  """Where the vocabulary of `corpus` (the training split) and these settings is kept for every
  run: beside the prepared data, under a hash of both."""
  key = sources.digest(corpus.digest, config.vocab_size, config.vocab_model_type,
                       config.vocab_sample_size, config.seed, *tag_pieces(config))
  return os.path.join(sources.prepared_dir(config), 'vocabularies', key[:16], 'sentencepiece.model')


def load_or_train_model(config: ml_collections.ConfigDict, corpus: sources.Corpus) -> bytes:
  """The model proto of the vocabulary of `corpus` (config's training split) and config's
  settings: the stored one, or trained and stored first."""
  path = stored_path(config, corpus)
  if epath.Path(path).exists():
    logging.info('vocabulary read from %s', path)
    return epath.Path(path).read_bytes()
  began = time.time()
  model = train_model(config, corpus)
  with sources.writing_prepared(config):
    write_atomically(path, model)
  logging.info('vocabulary trained in %.1f s: %s', time.time() - began, path)
  return model


def load_or_train_vocabulary(config: ml_collections.ConfigDict, workdir: str,
                             process_index: int | None = None,
                             corpus: sources.Corpus | None = None) -> Vocabulary:
  """The vocabulary in `<workdir>/vocab/`: process 0 puts it there first (the stored one, or
  trained and stored: `load_or_train_model` on `corpus`, the training split, loaded if not
  given); other hosts wait for it."""
  path = os.path.join(workdir, MARIAN_FILE if config.init_from else MODEL_FILE)
  if process_index is None:
    process_index = jax.process_index()
  if not epath.Path(path).exists():
    if process_index == 0 and config.init_from:
      write(marian_vocabulary(config.init_from), workdir)
    elif process_index == 0:
      corpus = corpus or sources.load_split(config, 'train')
      write_atomically(path, load_or_train_model(config, corpus))
    else:
      logging.info('waiting for process 0 to write the vocabulary: %s', path)
      deadline = time.time() + WAIT_SECS
      while not epath.Path(path).exists():
        if time.time() > deadline:
          raise DataError(f'{path}: process 0 did not write the vocabulary within {WAIT_SECS} s; '
                          'check its log, and that --workdir is on a filesystem all hosts share')
        time.sleep(1)
  return load_vocabulary(config, workdir)


def load_vocabulary(config: ml_collections.ConfigDict, workdir: str) -> Vocabulary:
  """The vocabulary train.py stored in `<workdir>/vocab/`."""
  if epath.Path(workdir, MARIAN_FILE).exists():
    return _load_marian(config, workdir)
  path = os.path.join(workdir, MODEL_FILE)
  damaged = (f'{path} is damaged: SentencePiece cannot read it; restore it from a copy (train.py '
             "keeps one under config.tfds_data_dir's vocabularies/)")
  try:
    vocab = Vocabulary(epath.Path(path).read_bytes())
  except FileNotFoundError:
    raise DataError(f'{path} not found: --workdir must be a directory train.py wrote') from None
  except (OSError, RuntimeError):  # a directory in its place; SentencePiece's parse error
    raise DataError(damaged) from None
  if vocab.vocab_size == 0:  # an empty file, which SentencePiece reads as no pieces
    raise DataError(damaged)
  if vocab.vocab_size != config.vocab_size:
    # train.py refuses another vocab_size before: the workdir's files disagree.
    raise DataError(f'{path} has {vocab.vocab_size} pieces but config.vocab_size='
                    f'{config.vocab_size} in the run\'s config.json: they are of other runs; '
                    'restore the run\'s own copies, or train in a new --workdir')
  missing = [tag for tag in tag_pieces(config) if tag not in vocab.tags]
  if missing:
    raise DataError(f'{path} has no piece {missing[0]} (config.pairs={config.pairs!r}, '
                    f'config.source_tags={config.source_tags!r}): it is the vocabulary of another '
                    'run; restore the run\'s own, or train in a new --workdir')
  return vocab


def tag_pieces(config: ml_collections.ConfigDict) -> list[str]:
  """The tags a source may start with, each a piece of its own: those of a multilingual config's
  target languages (config.pairs), then config.source_tags."""
  targets = [target for _, target in languages.pairs(config)] if config.pairs else []
  return ([languages.tag(target) for target in dict.fromkeys(targets)] +
          [tag for tag in config.source_tags.split(',') if tag])


def _load_marian(config: ml_collections.ConfigDict, workdir: str) -> MarianVocabulary:
  """The `MarianVocabulary` in `<workdir>/vocab/`."""
  directory = os.path.join(workdir, 'vocab')
  try:
    source, target, pieces = (epath.Path(directory, name).read_bytes() for name in MARIAN_FILES)
    vocab = MarianVocabulary(source, target, json.loads(pieces))
  except (OSError, RuntimeError, ValueError) as error:
    raise DataError(f'{directory} is damaged ({type(error).__name__}); restore it from the '
                    'Marian directory the run was started from (config.init_from)') from None
  if vocab.vocab_size != config.vocab_size:
    raise DataError(f'{directory} has {vocab.vocab_size} pieces but config.vocab_size='
                    f'{config.vocab_size} in the run\'s config.json: they are of other runs')
  return vocab
