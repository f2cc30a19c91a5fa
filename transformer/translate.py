"""Translation of raw sentences with a trained run: `Translator` (beam search over all local
devices, sentences grouped by length) and `load` (a workdir's translator and parameters)."""

import dataclasses
import math
import os
import sys
import time
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
import tqdm
from absl import flags, logging
from jax.experimental import multihost_utils

from transformer import checkpoints, data, decode, languages, marian, metrics, train_step
from transformer import config as config_lib
from transformer import stored_config
from transformer.kernels import choice, compile_ahead
from transformer.sampling import sample

LENGTH_STEP = 8  # padded source lengths are multiples of this: few compiled shapes
LOG_EVERY_SECS = 30  # progress lines when the output is not a terminal
# Pieces of bytes can spell a tab or a line end (any that str.splitlines splits at): translations
# are written one per line, in tables.
_BREAKS = '\t\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029'
ONE_LINE = str.maketrans(_BREAKS, ' ' * len(_BREAKS))


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


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Outputs drawn by `sampling.sample` instead of found by beam search.

  Attributes:
    temperature: the logits are divided by it; 0: greedy search.
    top_k: draw among the top_k most probable tokens; 0: all.
    top_p: then among the fewest most probable whose probability reaches top_p; 1: all.
    num_samples: outputs per sentence.
    seed: with a sentence's line number and the sample's, what its draws come from alone.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  num_samples: int = 1
  seed: int = 0


class Hypothesis(NamedTuple):
  """One output of a sentence: its text, its log-probability under the model, its score (the
  log-probability over the length penalty, what beam search ranks by) and its tokens, EOS
  included."""
  text: str
  log_prob: float
  score: float
  tokens: int


def model_configs(configs: list[ml_collections.ConfigDict],
                  implementations: choice.Implementations):
  """The model config of one run, or the tuple of an ensemble's (`decode`)."""
  models = tuple(config_lib.model_config(config, implementations) for config in configs)
  return models if len(models) > 1 else models[0]


def search_function(configs: list[ml_collections.ConfigDict],
                    implementations: choice.Implementations, beam_size: int, alpha: float,
                    nbest: int = 1, sampling: Sampling | None = None):
  """The decoding a `Translator` runs on each device: (params, sources [rows, length], their line
  numbers [rows]) -> (tokens [rows, n, length + decode_extra_length], log-probabilities [rows, n],
  scores [rows, n]) of beam search's n = nbest best hypotheses, best first (scores below
  decode.NEG_INF / 2 where it found fewer), or of sampling's n = num_samples draws."""
  model_config = model_configs(configs, implementations)
  extra_length = configs[0].decode_extra_length
  penalty = lambda tokens: decode.length_penalty((tokens > 0).sum(-1), alpha)

  def search(params, sources, line_numbers):
    if sampling is None:
      tokens, scores, _ = decode.beam_search(model_config, params, sources, beam_size=beam_size,
                                             alpha=alpha, extra_length=extra_length, nbest=nbest)
      return tokens, scores * penalty(tokens), scores
    first_key = jax.random.key(sampling.seed)
    keys = jax.vmap(lambda line: jax.random.split(jax.random.fold_in(first_key, line),
                                                  sampling.num_samples))(line_numbers)
    tokens, log_probs = sample(model_config, params, sources, keys, sampling.temperature,
                               sampling.top_k, sampling.top_p, extra_length)
    return tokens, log_probs, log_probs / penalty(tokens)

  return search


def scoring_function(configs: list[ml_collections.ConfigDict],
                     implementations: choice.Implementations):
  """What `Translator.score` runs on each device: (params, sources [rows, length], targets [rows,
  length], line numbers) -> (log P(target | source) [rows], target tokens [rows])."""
  model_config = model_configs(configs, implementations)

  def score(params, sources, targets, _):
    return (decode.sequence_log_probs(model_config, params, sources, targets),
            (targets > 0).sum(-1))

  return score


class Translator:
  """Beam search or sampling over all local devices, sentences grouped by length; outputs in input
  order. Also the log-probability of given translations (`score`).

  Args:
    config: the run's validated config (model, implementation, decode_extra_length, ...), or
      a list of several runs' configs sharing one vocabulary: their ensemble, with the first's
      settings.
    vocab: its vocabulary.
    beam_size: hypotheses kept per sentence.
    alpha: the length penalty's exponent.
    nbest: the best hypotheses beam search returns per sentence, at most beam_size.
    sampling: draw outputs so (`Sampling`) instead of searching for them.
  """

  def __init__(self, config: ml_collections.ConfigDict | list[ml_collections.ConfigDict],
               vocab: data.Vocabulary, beam_size: int, alpha: float, nbest: int = 1,
               sampling: Sampling | None = None):
    configs = config if isinstance(config, list) else [config]
    self.config, self.vocab, self.beam_size, self.alpha = configs[0], vocab, beam_size, alpha
    self.nbest, self.sampling = nbest, sampling
    implementations = choice.for_this_machine(self.config)
    self.devices = jax.local_device_count()
    # Each model of an ensemble holds the caches of its hypotheses.
    self.tokens_per_device = max(source_tokens_per_device(
        implementations, sampling.num_samples if sampling else beam_size) // len(configs),
                                 LENGTH_STEP)
    # Longer sources are cut to this: the model learned from none longer, a line of thousands
    # of words would take minutes (its compiled shape and output as long), and learned
    # positions cover no more (config.validate).
    self.max_source_tokens = self.config.max_length
    search = search_function(configs, implementations, beam_size, alpha, nbest, sampling)
    # Keyed by (rows per device, length).
    self.programs = compile_ahead.Programs(jax.pmap(search))
    self.scoring = compile_ahead.Programs(jax.pmap(scoring_function(configs, implementations)))

  @property
  def compile_secs(self) -> float:
    """Spent compiling so far (one host; several compile on first call)."""
    return self.programs.compile_secs + self.scoring.compile_secs

  def _program_args(self, params, rows: int, length: int, sides: int = 1):
    """The arguments of `programs.lower` and `programs.get` (or `scoring`'s, with 2 `sides`)
    for calls of [rows, length] per device."""
    return ((rows, length), params,
            *[jax.ShapeDtypeStruct((self.devices, rows, length), np.int32)] * sides,
            jax.ShapeDtypeStruct((self.devices, rows), np.int32))

  def encode(self, sentences: list[str], line_numbers: list[int] | None = None,
             lines: str = 'input line(s)', use: str = 'translated from'):
    """The ids the model reads for each of `sentences`: its pieces and EOS, cut to
    max_source_tokens (a warning names the `lines` cut by their `line_numbers`, if given, and
    what each is then `use`d as)."""
    encoded = self.vocab.encode_batch(sentences, add_eos=True)
    too_long = [i for i, ids in enumerate(encoded) if len(ids) > self.max_source_tokens]
    if too_long and line_numbers is not None:
      logging.warning(
          '%d %s have more than %d tokens (with EOS), the most config.max_length lets '
          'through: line %s; each is %s its first %d tokens only: split such lines into '
          'sentences', len(too_long), lines, self.max_source_tokens,
          ', line '.join(f'{line_numbers[i]} ({len(encoded[i])} tokens)' for i in too_long[:5]) +
          (', ...' if len(too_long) > 5 else ''), use, self.max_source_tokens)
    for i in too_long:
      encoded[i] = encoded[i][:self.max_source_tokens - 1] + encoded[i][-1:]  # and its EOS
    return encoded

  def _calls(self, inputs: list[tuple[list[int], ...]]):
    """The calls (`decode_batches`) that take `inputs`, each sentence's padded to its longest."""
    return decode_batches([max(map(len, sides)) for sides in inputs], self.tokens_per_device,
                          self.devices * jax.process_count())

  def search_programs(self, params, sentences: list[str]) -> list[tuple]:
    """The arguments of `programs.lower` and `programs.get` for each beam search that
    translating `sentences` takes, one per shape: what compiling them ahead needs."""
    calls = self._calls([(ids,) for ids in self.encode(sentences)])
    shapes = dict.fromkeys((rows, length) for _, rows, length in calls)
    return [self._program_args(params, rows, length) for rows, length in shapes]

  def translate(self, params, sentences: list[str], progress: bool = False,
                stop=None) -> list[str]:
    """Translations of `sentences`: the best hypothesis of each, or its first sample.

    Args:
      params: the model's parameters, replicated over the local devices (a tuple of such for an
        ensemble).
      sentences: raw source sentences.
      progress: show sentences done, their rate and the time left.
      stop: called before each decoding call (and each compilation); when it returns True,
        the translation ends with `Interrupted` (a preempted run saves first).

    Returns:
      One translation per sentence, in input order; an empty one for an empty or blank sentence,
      which the model would otherwise translate as a sentence of its own. A sentence of more
      than `max_source_tokens` is translated from its first ones, with a warning naming its line.

    Raises:
      Interrupted: `stop` returned True.
    """
    return [hypotheses[0].text if hypotheses else ''
            for hypotheses in self.hypotheses(params, sentences, progress, stop)]

  def hypotheses(self, params, sentences: list[str], progress: bool = False,
                 stop=None) -> list[list[Hypothesis]]:
    """Every sentence's nbest best hypotheses (best first), or its num_samples samples (in the
    order drawn); none for an empty or blank sentence. Tabs and line ends in their text are
    spaces. The arguments are `translate`'s."""
    numbers = [number for number, sentence in enumerate(sentences, 1) if sentence.strip()]
    outputs = dict(zip(numbers, self.search(params, [sentences[n - 1] for n in numbers], progress,
                                            stop, line_numbers=numbers)))
    return [[Hypothesis(self.vocab.decode(ids).translate(ONE_LINE), float(log_prob), float(score),
                        int((ids > 0).sum()))
             for ids, log_prob, score in zip(*outputs[n]) if score > decode.NEG_INF / 2]
            if n in outputs else [] for n in range(1, len(sentences) + 1)]

  def search(self, params, sentences: list[str], progress: bool = False, stop=None,
             line_numbers: list[int] | None = None) -> list[tuple[np.ndarray, ...]]:
    """The outputs of `search_function` for each sentence: (ids [n, width], EOS then padding
    ending each row; log-probabilities [n]; scores [n]). The arguments are `translate`'s, and the
    sentences' `line_numbers` in the input (default: 1, 2, ...), which name the lines cut in a
    warning and choose each sentence's samples."""
    line_numbers = line_numbers or list(range(1, len(sentences) + 1))
    inputs = [(ids,) for ids in self.encode(sentences, line_numbers)]
    return self._run(self.programs, params, inputs, line_numbers, progress, stop)

  def score(self, params, sources: list[str], targets: list[str],
            progress: bool = False) -> list[tuple[float, int]]:
    """(log P(target | source) summed over the target's tokens, that number of tokens) of each
    pair, EOS included; sides of more than max_source_tokens are cut to them, with a warning."""
    numbers = list(range(1, len(sources) + 1))
    inputs = list(zip(self.encode(sources, numbers, 'source line(s)', 'scored with'),
                      self.encode(targets, numbers, 'target line(s)', 'scored on')))
    return [(float(log_prob), int(tokens)) for log_prob, tokens in
            self._run(self.scoring, params, inputs, numbers, progress, stop=None)]

  def _run(self, programs: compile_ahead.Programs, params, inputs: list[tuple[list[int], ...]],
           line_numbers: list[int], progress: bool, stop) -> list[tuple[np.ndarray, ...]]:
    """The outputs of `programs`' function for each of `inputs` (one or more id lists), in calls
    of `_calls`.

    On several hosts every host passes all the inputs and gets all the outputs back, but each
    call is split over every host's devices: a host runs only its part of it. The hosts make the
    same calls in the same order (the pmapped function spans them all), so `stop` must agree
    across hosts.
    """
    calls = self._calls(inputs)
    hosts, host = jax.process_count(), jax.process_index()
    outputs_of = [None] * len(inputs)
    program = lambda rows, length: programs.get(
        *self._program_args(params, rows, length, len(inputs[0])))

    def check_stop():
      if stop is not None and stop():
        raise Interrupted(f'translation stopped after {sum(o is not None for o in outputs_of)} '
                          f'of {len(inputs)} sentences')

    for _, rows, length in calls:  # before the clock of the progress display starts
      check_stop()
      program(rows, length)
    shown = Progress(len(inputs)) if progress else None
    widest = None  # of each output, zeros of the largest shape of every call (all hosts')
    try:
      for indices, rows, length in calls:
        check_stop()
        # A short last call is filled with copies of its longest sentence, which finish with it.
        filled = np.concatenate([indices,
                                 np.full(rows * self.devices * hosts - len(indices), indices[-1])])
        first = host * rows * self.devices  # this host's part starts at this sentence of the call
        mine = filled[first:first + rows * self.devices]
        batches = np.zeros((len(inputs[0]), len(mine), length), np.int32)
        for row, i in enumerate(mine):
          for side, ids in enumerate(inputs[i]):
            batches[side, row, :len(ids)] = ids
        numbers = np.asarray(line_numbers, np.int32)[mine].reshape(self.devices, rows)
        outputs = [np.asarray(output).reshape((len(mine),) + output.shape[2:])
                   for output in program(rows, length)(
                       params, *batches.reshape(len(batches), self.devices, rows, length),
                       numbers)]
        widest = [np.zeros(np.maximum(w.shape, o.shape[1:]), o.dtype)
                  for w, o in zip(widest or [o[0] for o in outputs], outputs)]
        for n, i in enumerate(indices[first:first + len(mine)]):
          outputs_of[i] = tuple(output[n] for output in outputs)
        if shown:
          shown.update(len(indices))
    finally:
      if shown:
        shown.close()
    if hosts > 1 and calls:
      outputs_of = self._gather(outputs_of, calls, widest)
    return outputs_of

  def _gather(self, outputs_of: list, calls, widest: list) -> list[tuple[np.ndarray, ...]]:
    """Every input's outputs, from the host that made them (see `_run`), each padded with zeros
    to the shape of its kind in `widest`."""
    gathered = []
    for part, zeros in enumerate(widest):
      local = np.zeros((len(outputs_of),) + zeros.shape, zeros.dtype)
      for i, output in enumerate(outputs_of):
        if output is not None:
          local[(i,) + tuple(slice(0, n) for n in output[part].shape)] = output[part]
      gathered.append(multihost_utils.process_allgather(local))  # [hosts, inputs, ...]
    owner = np.zeros(len(outputs_of), np.int64)
    for indices, rows, _ in calls:  # where an input sits in its call says whose it was
      owner[indices] = np.arange(len(indices)) // (rows * self.devices)
    return [tuple(everyone[owner[i], i] for everyone in gathered) for i in range(len(outputs_of))]


class DecodingFlags:
  """--average_last, --up_to_step, --beam_size and --alpha, which every command that translates
  takes (a command that only scores, the first two); their defaults are the run's config's (the
  newest checkpoints for --up_to_step). And --target_lang, which picks the pair of a multilingual
  run (`pair`)."""

  def __init__(self, search: bool = True):
    self.names = ('average_last', 'up_to_step') + (('beam_size', 'alpha') if search else ())
    self.target_lang = flags.DEFINE_string(
        'target_lang', None, 'The language to translate into, for a run of several pairs '
        '(config.pairs): each source starts with its tag. A run of one pair needs none.')
    self.average_last = flags.DEFINE_integer(
        'average_last', None, 'Average the last N checkpoints (default: the config\'s '
        'average_last, as the paper evaluates: 5 for base, 20 for big).')
    self.up_to_step = flags.DEFINE_integer(
        'up_to_step', None, 'Average the last checkpoints at or before this step: the run as it '
        'stood then, for a learning curve (default: the newest).', lower_bound=0)
    if not search:
      return
    self.beam_size = flags.DEFINE_integer('beam_size', None,
                                          'Beam size (default: the config\'s).', lower_bound=1)
    self.alpha = flags.DEFINE_float('alpha', None,
                                    'Length penalty alpha (default: the config\'s).')
    # A bound alone lets nan and inf through.
    flags.register_validator(self.alpha, lambda value: value is None or 0 <= value < math.inf,
                             'must be a finite number >= 0 (0: no length penalty)')

  def values(self) -> dict:
    """The flags' values, as `load` takes them."""
    return {name: getattr(self, name).value for name in self.names}

  def pair(self, config: ml_collections.ConfigDict) -> tuple[str, str] | None:
    """The pair of a multilingual run (config.pairs) that translates into --target_lang (the
    first, where several do); None for a run of one pair, which --target_lang may only name.

    Raises:
      ConfigError: --target_lang is missing for a multilingual run, or names a language the run
        does not translate into.
    """
    pairs, target = languages.pairs(config), self.target_lang.value
    targets = ', '.join(dict.fromkeys(pair_target for _, pair_target in pairs))
    if not config.pairs:
      if target not in (None, config.target_lang):
        raise config_lib.ConfigError(
            f'--target_lang={target}: the run translates {config.source_lang} into '
            f'{config.target_lang} only: give --target_lang={config.target_lang} or none')
      return None
    if target is None:
      raise config_lib.ConfigError(
          f'the run translates into {targets} (config.pairs={config.pairs!r}): give '
          '--target_lang=LANG, one of those')
    chosen = [pair for pair in pairs if pair[1] == target]
    if not chosen:
      raise config_lib.ConfigError(
          f'--target_lang={target}: the run was not trained to translate into it (config.pairs='
          f'{config.pairs!r}); give one of {targets}')
    return chosen[0]


def tag_sources(pair: tuple[str, str] | None, sentences: list[str]) -> list[str]:
  """`sentences`, each (but a blank one) starting with the tag of `pair`'s target language, as a
  multilingual run reads them (`DecodingFlags.pair`); as they are for `pair` None."""
  return data.tagged(languages.tag(pair[1]), sentences) if pair else sentences


def load(workdir: str | list[str], average_last: int | None = None,
         beam_size: int | None = None, alpha: float | None = None,
         up_to_step: int | None = None, config: ml_collections.ConfigDict | None = None,
         nbest: int = 1, sampling: Sampling | None = None):
  """What translating with a trained run, or an ensemble of runs, takes, as eval.py, translate.py
  and score.py use it.

  Args:
    workdir: a train.py workdir, or a Hugging Face Marian directory (its weights as they are); a
      list of several: their ensemble, which must share a vocabulary and languages.
    average_last: checkpoints to average in each run (None: its config's average_last).
    beam_size: None: the (first) config's.
    alpha: None: the (first) config's.
    up_to_step: average the checkpoints at or before this step (None: the newest).
    config: the (first) workdir's config, if loaded already (`config.load_workdir_config`); a
      Marian directory's is needed.
    nbest: the best hypotheses to return per sentence.
    sampling: sample instead of searching (`Sampling`).

  Returns:
    (a `Translator`, the parameters replicated over the local devices (a tuple of each run's for
    an ensemble), the (first) run's config, the checkpoint steps averaged (None for a Marian
    directory; a list of each run's for an ensemble)).

  Raises:
    ConfigError, DataError, CheckpointError, MarianError: a workdir is not a usable run, or the
      runs cannot make an ensemble; the message says why.
  """
  workdirs = workdir if isinstance(workdir, list) else [workdir]
  configs = [choice.runnable_here(config if n == 0 and config is not None else
                                  stored_config.load_workdir_config(path))
             for n, path in enumerate(workdirs)]
  vocabs = [data.marian_vocabulary(path) if marian.is_marian_directory(path) else
            data.load_vocabulary(run_config, path) for path, run_config in zip(workdirs, configs)]
  for path, run_config, run_vocab in list(zip(workdirs, configs, vocabs))[1:]:
    _check_ensemble(workdirs[0], configs[0], vocabs[0], path, run_config, run_vocab)
  beam_size = configs[0].beam_size if beam_size is None else beam_size
  alpha = configs[0].alpha if alpha is None else alpha
  if not 1 <= nbest <= beam_size:
    raise config_lib.ConfigError(f'--nbest={nbest} asks for more hypotheses than a beam of '
                                 f'{beam_size} keeps: give --beam_size={nbest} or more')
  if sampling and sampling.top_k > vocabs[0].vocab_size:
    raise config_lib.ConfigError(f'--top_k={sampling.top_k} is more than the '
                                 f'{vocabs[0].vocab_size} tokens of the vocabulary: give fewer, '
                                 'or 0 for all')
  loaded = [_params(path, run_config, average_last, up_to_step)
            for path, run_config in zip(workdirs, configs)]
  translator = Translator(configs if len(configs) > 1 else configs[0], vocabs[0], beam_size,
                          alpha, nbest, sampling)
  params = tuple(train_step.replicate(run_params) for run_params, _ in loaded)
  steps = [run_steps for _, run_steps in loaded]
  if len(loaded) == 1:
    return translator, params[0], configs[0], steps[0]
  return translator, params, configs[0], steps


def _params(workdir: str, config: ml_collections.ConfigDict, average_last: int | None,
            up_to_step: int | None):
  """(parameters, checkpoint steps averaged) of one run; `load`'s arguments."""
  if marian.is_marian_directory(workdir):
    if average_last is not None or up_to_step is not None:
      raise config_lib.ConfigError(f'{workdir} is a Hugging Face Marian model, one set of weights: '
                                   '--average_last and --up_to_step choose checkpoints of a '
                                   'train.py run')
    return marian.import_params(workdir, config_lib.model_config(config)), None
  return checkpoints.load_params(workdir, config, average_last, up_to_step)


def _check_ensemble(first: str, first_config, first_vocab, other: str, other_config,
                    other_vocab):
  """Raises ConfigError unless the run in `other` can decode in an ensemble with `first`'s."""
  languages = lambda config: config.pairs or f'{config.source_lang}-{config.target_lang}'
  if languages(first_config) != languages(other_config):
    raise config_lib.ConfigError(
        f'{first} translates {languages(first_config)} but {other} {languages(other_config)}: an '
        'ensemble needs runs of the same language pairs')
  if first_vocab.files() != other_vocab.files():
    raise config_lib.ConfigError(
        f'{first} and {other} have different vocabularies: an ensemble averages the '
        "probabilities of the same tokens, so its runs must share one: train the others with "
        f'{os.path.join(first, "vocab")} copied into their workdir before train.py starts (the '
        'seed draws the sample a vocabulary learns from, so runs of other seeds train others)')
