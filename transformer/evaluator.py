"""Evaluation during training: the validation loss and BLEU of each language pair, their programs
compiled on a background thread while the training step compiles (kernels/compile_ahead.py), and
the closing BLEU of the averaged checkpoints."""

import itertools

import jax
from absl import logging

from transformer import bleu, data, languages, metrics, train_step, translate
from transformer import config as config_lib
from transformer.checkpoints import Checkpoints, state_shapes
from transformer.kernels import compile_ahead
from transformer.preemption import Preemption

SAMPLES = 8  # translations shown in TensorBoard at each BLEU evaluation


class Evaluator:
  """Validation loss and BLEU at given parameters, of each language pair of a multilingual model
  apart; each split is read and tokenized once."""

  def __init__(self, config, vocab, step_fns: train_step.StepFunctions, shard: dict,
               writer: metrics.MetricsWriter):
    self.config, self.vocab, self.shard, self.writer = config, vocab, shard, writer
    self.step_fns = step_fns
    # Keyed by the batch's shapes.
    self.eval_programs = compile_ahead.Programs(jax.pmap(step_fns.eval_step, train_step.AXIS))
    self.translator = translate.Translator(config, vocab, config.beam_size, config.alpha)
    # (source, target) of each pair of a multilingual model; None: the one pair, untagged.
    self.pairs = languages.pairs(config) if config.pairs else [None]
    self.batches = {}  # (split, pair) -> its loss batches
    self.texts = {}  # (split, pair) -> (sources, references)
    self.ahead = compile_ahead.Background()

  def compile_ahead(self, packed_params, loss_splits: list[str], bleu_splits: list[str]):
    """Prepares the loss step of `loss_splits`' batches and the beam searches of `bleu_splits`
    on a background thread (a cold start spends seconds on these programs): lowers them while the
    training step compiles, compiles them once `training_started` is called
    (`compile_ahead.Background`). Where one is not ready when needed, `loss` and `bleu` wait for
    it. Not on several hosts: reading a split gathers from every host, which must not happen
    beside the training loop's own gathers, and pmap compiles no programs ahead there."""
    if jax.process_count() > 1:
      return
    packed_params = compile_ahead.shapes_of(packed_params)  # the next step donates their buffers
    # The beam searches take the parameters' tree, as `bleu` gets it.
    params = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((jax.local_device_count(), *x.shape), x.dtype),
        self.step_fns.param_shapes)

    def programs_and_args():  # in the order the run needs them
      for split, pair in itertools.product(loss_splits, self.pairs):
        for batch in self._loss_batches(split, pair):
          yield self.eval_programs, (self._loss_key(batch), packed_params, batch)
      for split, pair in itertools.product(bleu_splits, self.pairs):
        try:
          sources = self._texts(split, pair)[0]
        except data.DataError:
          continue  # `bleu` reports it when it gets there
        for args in self.translator.search_programs(params, sources):
          yield self.translator.programs, args

    self.ahead.start(programs_and_args(), 'evaluation programs')

  def training_started(self):
    """Lets `compile_ahead`'s thread compile: the training step has compiled."""
    self.ahead.compile()

  def close(self):
    """Stops `compile_ahead`'s thread after the program at hand, and waits for it (a preempted
    run has seconds left)."""
    self.ahead.close()

  def _loss_batches(self, split: str, pair) -> list:
    if (split, pair) not in self.batches:
      self.batches[split, pair] = list(data.eval_batches(
          self.config, self.vocab, split, **self.shard,
          corpus=data.load_split(self.config, split, pair)))
    return self.batches[split, pair]

  def _texts(self, split: str, pair) -> tuple[list[str], list[str]]:
    """(sources, references) of `split` (of `pair`). Raises DataError where it has none."""
    if (split, pair) not in self.texts:
      self.texts[split, pair] = data.split_texts(self.config, split, pair)
    return self.texts[split, pair]

  @staticmethod
  def _loss_key(batch) -> tuple:
    return tuple((name, value.shape) for name, value in sorted(batch.items()))

  def loss(self, params, step: int, split: str):
    """Logs the loss on `split` (on each pair's part) at a packed state's `params`."""
    for pair in self.pairs:
      sums = [self.eval_programs.get(self._loss_key(batch), params, batch)(params, batch)
              for batch in self._loss_batches(split, pair)]
      summary = metrics.summarize([jax.tree_util.tree_map(lambda x: x[0], s)
                                   for s in jax.device_get(sums)])
      values = {k: summary[k] for k in ('loss', 'nll', 'perplexity', 'accuracy')}
      logging.info('%s at step %d: loss %.4f | nll %.4f | ppl %.2f | acc %.1f%%',
                   _name(split, pair), step, values['loss'], values['nll'], values['perplexity'],
                   100 * values['accuracy'])
      self.writer.write(step, values, split=split, pair=pair and '-'.join(pair))

  def bleu(self, params, step: int, split: str, checkpoint_steps: list[int] | None = None,
           stop=None) -> bool:
    """Translates `split` (each pair's part); logs both BLEUs and a few examples (and which
    checkpoints were averaged into `params`, if given). False if `stop` (see
    `Translator.translate`) cut it short."""
    return all(self._pair_bleu(params, step, split, pair, checkpoint_steps, stop)
               for pair in self.pairs)

  def _pair_bleu(self, params, step: int, split: str, pair, checkpoint_steps, stop) -> bool:
    name = _name(split, pair)
    try:
      sources, references = self._texts(split, pair)
    except data.DataError as error:
      logging.warning('no BLEU on %s: %s', name, error)
      return True
    logging.info('translating %s (%d sentences) at step %d', name, len(sources), step)
    try:
      # With its progress and time left: an untrained model's outputs are long.
      hypotheses = self.translator.translate(params, sources, progress=True, stop=stop)
    except translate.Interrupted as error:
      logging.info('%s BLEU at step %d: %s', name, step, error)
      return False
    language = pair[1] if pair else self.config.target_lang
    values = {'sacrebleu': bleu.sacrebleu_score(hypotheses, references, language)[0],
              'bleu_paper': bleu.paper_bleu(hypotheses, references, language,
                                            config_lib.compound_split(self.config, language))}
    logging.info('%s BLEU at step %d%s: sacreBLEU %.2f | paper BLEU %.2f (%d sentences)', name,
                 step, f', checkpoints {checkpoint_steps} averaged' if checkpoint_steps else '',
                 values['sacrebleu'], values['bleu_paper'], len(sources))
    if checkpoint_steps:
      values['checkpoint_steps'] = checkpoint_steps
    samples = list(zip(sources, references, hypotheses))[:SAMPLES]
    for source, reference, hypothesis in samples[:3]:
      logging.info('  source:      %s\n  reference:   %s\n  translation: %s', source, reference,
                   hypothesis)
    self.writer.write(step, values, split=split, pair=pair and '-'.join(pair))
    self.writer.write_text(step, f'{name.replace(" ", "/")}/translations', samples_table(samples))
    return True


def _name(split: str, pair) -> str:
  """`split`, and the language pair of a multilingual model's part of it: 'validation en-de'."""
  return f'{split} {"-".join(pair)}' if pair else split


def samples_table(samples: list[tuple[str, str, str]]) -> str:
  """A markdown table of (source, reference, translation) rows, '|' escaped."""
  cell = lambda text: text.replace('\\', '\\\\').replace('|', '\\|')
  return '\n'.join(['| source | reference | translation |', '| --- | --- | --- |'] +
                   [f'| {cell(s)} | {cell(r)} | {cell(h)} |' for s, r, h in samples])


def final_bleu_splits(config) -> list[str]:
  """The splits training ends by scoring (config.final_bleu_splits)."""
  return [split for split in config.final_bleu_splits.split(',') if split]


def final_bleu(config, checkpoints: Checkpoints, evaluator: Evaluator,
               preemption: Preemption):
  """Both BLEUs on config.final_bleu_splits with the mean of the last config.average_last
  checkpoints, as eval.py scores the finished run by default (section 6.1 of the paper); a
  SIGTERM or Ctrl-C ends them at once, the checkpoints being written."""
  if not final_bleu_splits(config):
    return
  checkpoints.wait()
  preemption.exit_message = (
      f'stopped in the closing BLEU: every checkpoint is saved, the last at step '
      f'{checkpoints.latest_step()}; eval.py --workdir=DIR scores the run')
  params, averaged_steps = checkpoints.mean_params(config.average_last, state_shapes(config))
  params = train_step.replicate(params)
  for split in final_bleu_splits(config):
    evaluator.bleu(params, config.num_train_steps, split, checkpoint_steps=averaged_steps)
