"""Translation of raw sentences with a trained run: `Translator` (beam search over all local
devices, sentences grouped by length) and `load` (a workdir's translator and parameters)."""

import math
import sys
import time

import jax
import ml_collections
import numpy as np
import tqdm
from absl import flags, logging
from jax.experimental import multihost_utils

from transformer import checkpoints, data, decode, marian, metrics, train_step
from transformer import config as config_lib
from transformer.kernels import choice, compile_ahead

LENGTH_STEP = 8  # padded source lengths are multiples of this: few compiled shapes
LOG_EVERY_SECS = 30  # progress lines when the output is not a terminal


def decode_batches(lengths: list[int], tokens_per_device: int, devices: int):
  """(sentence indices, rows per device, padded length) of each beam-search call.

  Sentences go shortest first; a call's length is its longest sentence's, rounded up to
  LENGTH_STEP, and its rows per device are the largest power of two whose tokens fit the budget
  at that length, so each length compiles one shape. Every call but the last is full.
  """
  padded = -(-np.asarray(lengths, np.int64) // LENGTH_STEP) * LENGTH_STEP
  order = np.argsort(padded, kind='stable')
  rows_at = lambda length: 2 ** int(np.log2(max(1, tokens_per_device // length)))
  batches, start = [], 0
  while start < len(order):
    length = padded[order[start]]
    end = min(start + rows_at(length) * devices, len(order))
    while rows_at(padded[order[end - 1]]) < rows_at(length):  # the longest needs fewer rows
      length = padded[order[end - 1]]
      end = min(start + rows_at(length) * devices, len(order))
    length = max(length, padded[order[end - 1]])
    batches.append((order[start:end], rows_at(length), int(length)))
    start = end
  return batches


class Progress:
  """Sentences translated, sentences/s and time left: a tqdm bar on a terminal; elsewhere (a log
  file, a pipe) a log line at each tenth of the sentences or LOG_EVERY_SECS, whichever is first."""

  def __init__(self, total: int):
    self.total, self.done, self.began = total, 0, time.time()
    self.logged_at, self.logged_tenths = self.began, 0
    self.bar = (tqdm.tqdm(total=total, unit='sentence', file=sys.stderr, dynamic_ncols=True)
                if sys.stderr.isatty() else None)

  def update(self, count: int):
    self.done += count
    if self.bar is not None:
      self.bar.update(count)
      return
    tenths = 10 * self.done // max(self.total, 1)
    if tenths > self.logged_tenths or time.time() - self.logged_at >= LOG_EVERY_SECS:
      self.logged_at, self.logged_tenths = time.time(), tenths
      secs = time.time() - self.began
      rate = self.done / max(secs, 1e-9)
      logging.info('translated %d/%d sentences | %.1f sentences/s | eta %s', self.done,
                   self.total, rate, metrics.hours_minutes_seconds((self.total - self.done) / rate))

  def close(self):
    if self.bar is not None:
      self.bar.close()


class Interrupted(Exception):
  """A translation stopped before its end because its `stop` callback asked for it."""


def source_tokens_per_device(implementations: choice.Implementations, beam_size: int) -> int:
  """Source tokens a device takes per beam-search call: beam_size hypotheses of each sentence
  share the machine's decode budget."""
  return max(implementations.decode_batch_tokens // beam_size, LENGTH_STEP)


def search_function(config: ml_collections.ConfigDict, implementations: choice.Implementations,
                    beam_size: int, alpha: float):
  """The beam search a `Translator` runs on each device: (params, sources [rows, length]) -> the
  best output's ids [rows, length + config.decode_extra_length]."""
  model_config = config_lib.model_config(config, implementations)

  def search(params, sources):
    return decode.beam_search(model_config, params, sources, beam_size=beam_size, alpha=alpha,
                              extra_length=config.decode_extra_length)[0]

  return search


class Translator:
  """Beam search over all local devices, sentences grouped by length; outputs in input order.

  Args:
    config: the run's validated config (model, decode_batch_tokens, decode_extra_length, ...).
    vocab: its vocabulary.
    beam_size: hypotheses kept per sentence.
    alpha: the length penalty's exponent.
  """

  def __init__(self, config: ml_collections.ConfigDict, vocab: data.Vocabulary, beam_size: int,
               alpha: float):
    self.config, self.vocab, self.beam_size, self.alpha = config, vocab, beam_size, alpha
    implementations = choice.for_this_machine(config)
    self.devices = jax.local_device_count()
    self.tokens_per_device = source_tokens_per_device(implementations, beam_size)
    # Longer sources are cut to this: the model learned from none longer, a line of thousands
    # of words would take minutes (its compiled shape and output as long), and learned
    # positions cover no more (config.validate).
    self.max_source_tokens = config.max_length
    search = search_function(config, implementations, beam_size, alpha)
    self.programs = compile_ahead.Programs(jax.pmap(search))  # keyed by (rows per device, length)

  @property
  def compile_secs(self) -> float:
    """Spent compiling so far (one host; several compile on first call)."""
    return self.programs.compile_secs

  def _search_for(self, params, rows: int, length: int):
    """The beam search compiled for [devices, rows, length] sources, compiled on first use."""
    return self.programs.get(*self._search_args(params, rows, length))

  def _search_args(self, params, rows: int, length: int):
    return (rows, length), params, jax.ShapeDtypeStruct((self.devices, rows, length), np.int32)

  def encode(self, sentences: list[str], line_numbers: list[int] | None = None):
    """The ids the model translates each of `sentences` from: its pieces and EOS, cut to
    max_source_tokens (a warning names the lines cut by their `line_numbers`, if given)."""
    encoded = self.vocab.encode_batch(sentences, add_eos=True)
    too_long = [i for i, ids in enumerate(encoded) if len(ids) > self.max_source_tokens]
    if too_long and line_numbers is not None:
      logging.warning(
          '%d input line(s) have more than %d tokens (with EOS), the most config.max_length lets '
          'through: line %s; each is translated from its first %d tokens only: split such lines '
          'into sentences', len(too_long), self.max_source_tokens,
          ', line '.join(f'{line_numbers[i]} ({len(encoded[i])} tokens)' for i in too_long[:5]) +
          (', ...' if len(too_long) > 5 else ''), self.max_source_tokens)
    for i in too_long:
      encoded[i] = encoded[i][:self.max_source_tokens - 1] + encoded[i][-1:]  # and its EOS
    return encoded

  def _plan(self, sentences: list[str], line_numbers: list[int] | None = None):
    """The sentences' ids (`encode`) and the beam-search calls that translate them
    (`decode_batches`)."""
    encoded = self.encode(sentences, line_numbers)
    return encoded, decode_batches([len(ids) for ids in encoded], self.tokens_per_device,
                                   self.devices * jax.process_count())

  def search_programs(self, params, sentences: list[str]) -> list[tuple]:
    """The arguments of `programs.lower` and `programs.get` for each beam search that
    translating `sentences` takes, one per shape: what compiling them ahead needs."""
    shapes = dict.fromkeys((rows, length) for _, rows, length in self._plan(sentences)[1])
    return [self._search_args(params, rows, length) for rows, length in shapes]

  def translate(self, params, sentences: list[str], progress: bool = False,
                stop=None) -> list[str]:
    """Translations of `sentences`.

    Args:
      params: the model's parameters, replicated over the local devices.
      sentences: raw source sentences.
      progress: show sentences done, their rate and the time left.
      stop: called before each beam-search call (and each compilation); when it returns True,
        the translation ends with `Interrupted` (a preempted run saves first).

    Returns:
      One translation per sentence, in input order; an empty one for an empty or blank sentence,
      which the model would otherwise translate as a sentence of its own. A sentence of more
      than `max_source_tokens` is translated from its first ones, with a warning naming its line.

    Raises:
      Interrupted: `stop` returned True.
    """
    numbers = [number for number, sentence in enumerate(sentences, 1) if sentence.strip()]
    outputs = dict(zip(numbers, self.search(params, [sentences[n - 1] for n in numbers], progress,
                                            stop, line_numbers=numbers)))
    return [self.vocab.decode(outputs[n]) if n in outputs else ''
            for n in range(1, len(sentences) + 1)]

  def search(self, params, sentences: list[str], progress: bool = False, stop=None,
             line_numbers: list[int] | None = None) -> list[np.ndarray]:
    """The beam search's best output ids of each sentence (EOS, then padding, end them); the
    arguments are `translate`'s, and the sentences' `line_numbers` in the input (default: 1,
    2, ...) for the warning about lines cut.

    On several hosts every host passes all the sentences and gets all the outputs back, but each
    call is split over every host's devices: a host translates only its part of it. The hosts
    make the same calls in the same order (the pmapped search spans them all), so `stop` must
    agree across hosts.
    """
    encoded, calls = self._plan(sentences, line_numbers or list(range(1, len(sentences) + 1)))
    hosts, host = jax.process_count(), jax.process_index()
    outputs_of = [None] * len(sentences)

    def check_stop():
      if stop is not None and stop():
        raise Interrupted(f'translation stopped after {sum(o is not None for o in outputs_of)} '
                          f'of {len(sentences)} sentences')

    for _, rows, length in calls:  # before the clock of the progress display starts
      check_stop()
      self._search_for(params, rows, length)
    shown = Progress(len(sentences)) if progress else None
    try:
      for indices, rows, length in calls:
        check_stop()
        # A short last call is filled with copies of its longest sentence, which finish with it.
        filled = np.concatenate([indices,
                                 np.full(rows * self.devices * hosts - len(indices), indices[-1])])
        first = host * rows * self.devices  # this host's part starts at this sentence of the call
        mine = filled[first:first + rows * self.devices]
        batch = np.zeros((len(mine), length), np.int32)
        for row, i in enumerate(mine):
          batch[row, :len(encoded[i])] = encoded[i]
        outputs = np.asarray(self._search_for(params, rows, length)(
            params, batch.reshape(self.devices, rows, length)))
        for i, ids in zip(indices[first:], outputs.reshape(-1, outputs.shape[-1])):
          outputs_of[i] = ids
        if shown:
          shown.update(len(indices))
    finally:
      if shown:
        shown.close()
    if hosts > 1 and calls:
      outputs_of = self._gather(outputs_of, calls)
    return outputs_of

  def _gather(self, outputs_of: list, calls) -> list[np.ndarray]:
    """Every sentence's outputs, from the host that translated it (see `search`)."""
    width = max(length for _, _, length in calls) + self.config.decode_extra_length
    local = np.zeros((len(outputs_of), width), np.int32)
    for i, ids in enumerate(outputs_of):
      if ids is not None:
        local[i, :len(ids)] = ids
    everyone = multihost_utils.process_allgather(local)  # [hosts, sentences, width]
    owner = np.zeros(len(outputs_of), np.int64)
    for indices, rows, _ in calls:  # where a sentence sits in its call says whose it was
      owner[indices] = np.arange(len(indices)) // (rows * self.devices)
    return list(everyone[owner, np.arange(len(outputs_of))])


class DecodingFlags:
  """--average_last, --up_to_step, --beam_size and --alpha, which every command that translates
  takes; their defaults are the run's config's (the newest checkpoints for --up_to_step)."""

  def __init__(self):
    self.average_last = flags.DEFINE_integer(
        'average_last', None, 'Average the last N checkpoints (default: the config\'s '
        'average_last, as the paper evaluates: 5 for base, 20 for big).')
    self.up_to_step = flags.DEFINE_integer(
        'up_to_step', None, 'Average the last checkpoints at or before this step: the run as it '
        'stood then, for a learning curve (default: the newest).', lower_bound=0)
    self.beam_size = flags.DEFINE_integer('beam_size', None,
                                          'Beam size (default: the config\'s).', lower_bound=1)
    self.alpha = flags.DEFINE_float('alpha', None,
                                    'Length penalty alpha (default: the config\'s).')
    # A bound alone lets nan and inf through.
    flags.register_validator(self.alpha, lambda value: value is None or 0 <= value < math.inf,
                             'must be a finite number >= 0 (0: no length penalty)')

  def values(self) -> dict:
    """The flags' values, as `load` takes them."""
    return {name: getattr(self, name).value
            for name in ('average_last', 'beam_size', 'alpha', 'up_to_step')}


def load(workdir: str, average_last: int | None = None, beam_size: int | None = None,
         alpha: float | None = None, up_to_step: int | None = None,
         config: ml_collections.ConfigDict | None = None):
  """What translating with a trained run takes, as eval.py and translate.py use it.

  Args:
    workdir: a train.py workdir, or a Hugging Face Marian directory (its weights as they are).
    average_last: checkpoints to average (None: the config's average_last).
    beam_size: None: the config's.
    alpha: None: the config's.
    up_to_step: average the checkpoints at or before this step (None: the newest).
    config: the workdir's config, if loaded already (`config.load_workdir_config`); a Marian
      directory's is needed.

  Returns:
    (a `Translator`, the parameters replicated over the local devices, the run's config, the
    checkpoint steps averaged (None for a Marian directory)).

  Raises:
    ConfigError, DataError, CheckpointError, MarianError: the workdir is not a usable run; the
      message says why.
  """
  if config is None:
    config = config_lib.load_workdir_config(workdir)
  config = choice.runnable_here(config)
  if marian.is_marian_directory(workdir):
    if average_last is not None or up_to_step is not None:
      raise config_lib.ConfigError(f'{workdir} is a Hugging Face Marian model, one set of weights: '
                                   '--average_last and --up_to_step choose checkpoints of a '
                                   'train.py run')
    vocab = data.marian_vocabulary(workdir)
    params, steps = marian.import_params(workdir, config_lib.model_config(config)), None
  else:
    vocab = data.load_vocabulary(config, workdir)
    params, steps = checkpoints.load_params(workdir, config, average_last, up_to_step)
  translator = Translator(config, vocab, config.beam_size if beam_size is None else beam_size,
                          config.alpha if alpha is None else alpha)
  return translator, train_step.replicate(params), config, steps
