r"""Translates sentences with a trained run: one sentence per line in, one translation per line out.

  python translate.py --workdir=DIR [--workdir=DIR2 ...] [--input=FILE] [--output=FILE]
      [--average_last=N] [--up_to_step=S] [--beam_size=B] [--alpha=A] [--nbest=N]
      [--sampling=greedy|topk|topp [--top_k=K] [--top_p=P] [--temperature=T] [--seed=S]
      [--num_samples=M]] [--target_lang=LANG]

reads --input (default: stdin) and writes --output (default: stdout), with the mean of the run's
last average_last checkpoints and its beam search settings unless the flags say otherwise.
A run of several language pairs (config.pairs) translates into --target_lang: each line starts
with that language's tag (<2fr>) before the model reads it.

--workdir may be a Hugging Face Marian directory instead (an OPUS-MT model, an export.py output):
its weights as they are, with its generation_config.json's beam size and length penalty.

Several --workdir decode as an ensemble: at every step the mean of the runs' log-probabilities
(renormalized), with the first run's settings; the runs must share their vocabulary.

--nbest=N writes beam search's N best hypotheses of each line, --num_samples=M sampling's M draws,
as tab-separated rows under a header: `line` (its number in the input), `hypothesis` (1 = the
best, or the first draw), `log_prob` (under the model), `score` (log_prob over the length
penalty, what beam search ranks by), `tokens` (EOS included) and `translation`. A blank line has
no rows.

--sampling draws each token instead: `greedy` the most probable, `topk` among the --top_k most
probable (0: all of them, unrestricted sampling), `topp` among the fewest most probable whose
probability reaches --top_p (nucleus sampling), after dividing the logits by --temperature. The
draws of a line depend only on --seed, its line number and the model: not on the batch or the
number of devices.
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('translate.py')

import math
import sys
import time

from absl import app, flags, logging

from configs import default
from transformer import checkpoints, commands, data, files, marian, translate
from transformer import config as config_lib
from transformer import stored_config

_WORKDIR = flags.DEFINE_multi_string(
    'workdir', None, 'A train.py workdir (config.json, vocab/, checkpoints/), or a Hugging Face '
    'Marian directory; several: their ensemble.')
_INPUT = flags.DEFINE_string('input', None, 'Sentences, one per line (default: stdin).')
_OUTPUT = flags.DEFINE_string('output', None, 'Where translations go (default: stdout).')
_DECODING = translate.DecodingFlags()
flags.adopt_module_key_flags(translate)  # --helpshort lists them
_NBEST = flags.DEFINE_integer('nbest', None, "Write beam search's N best hypotheses of each line "
                              '(at most --beam_size), as rows of a table.', lower_bound=1)
_SAMPLING = flags.DEFINE_enum('sampling', None, ['greedy', 'topk', 'topp'],
                              'Draw each token instead of beam search.')
_TOP_K = flags.DEFINE_integer('top_k', 0, '--sampling=topk: among this many most probable tokens '
                              '(0: all).', lower_bound=0)
_TOP_P = flags.DEFINE_float('top_p', 1.0, '--sampling=topp: among the fewest most probable tokens '
                            'whose probability reaches this, in (0, 1].')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, '--sampling=topk or topp: divide the logits '
                                  'by this (0: greedy search).')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling: what the draws come from.')
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', None, '--sampling=topk or topp: draws per line, '
                                    'as rows of a table.', lower_bound=1)
flags.mark_flag_as_required('workdir')
# A bound alone lets nan and inf through.
flags.register_validator(_TOP_P, lambda value: 0 < value <= 1, 'must be in (0, 1]')
flags.register_validator(_TEMPERATURE, lambda value: 0 <= value < math.inf,
                         'must be a finite number >= 0 (0: greedy search)')

TABLE_HEADER = 'line\thypothesis\tlog_prob\tscore\ttokens\ttranslation\n'


def sampling() -> translate.Sampling | None:
  """The --sampling settings, or None for beam search.

  Raises:
    ConfigError: a flag that this decoding does not use is given.
  """
  method = _SAMPLING.value
  named = lambda method: f'--sampling={method}' if method else 'beam search'
  used_by = {'top_k': ('topk',), 'top_p': ('topp',), 'temperature': ('topk', 'topp'),
             'seed': ('topk', 'topp'), 'num_samples': ('topk', 'topp'), 'nbest': (None,)}
  for name, methods in used_by.items():
    if flags.FLAGS[name].present and method not in methods:
      raise config_lib.ConfigError(f'--{name} is for {" or ".join(map(named, methods))}, not '
                                   f'{named(method)}')
  if method is None:
    return None
  if method == 'greedy':
    return translate.Sampling(temperature=0.0)
  return translate.Sampling(temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                            top_p=_TOP_P.value, num_samples=_NUM_SAMPLES.value or 1,
                            seed=_SEED.value)


def table(hypotheses: list[list[translate.Hypothesis]]) -> str:
  """The rows --nbest and --num_samples write, under TABLE_HEADER."""
  return TABLE_HEADER + ''.join(
      f'{line}\t{rank}\t{h.log_prob:.4f}\t{h.score:.4f}\t{h.tokens}\t{h.text}\n'
      for line, of_line in enumerate(hypotheses, 1) for rank, h in enumerate(of_line, 1))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    # A wrong --workdir, --output or flag fails before stdin is read.
    workdirs = _WORKDIR.value
    config = stored_config.load_workdir_config(workdirs[0], default.get_config)
    commands.set_up_jax(config, workdirs[0])
    drawing = sampling()
    pair = _DECODING.pair(config)
    if _OUTPUT.value:
      files.check_writable(_OUTPUT.value, f'--output={_OUTPUT.value}')
    # As bytes: a line that is not UTF-8 gets its number in a DataError, not a surrogate escape.
    if not _INPUT.value and sys.stdin is None:
      raise data.DataError('stdin is closed: pipe the sentences in, or give --input=FILE')
    if not _OUTPUT.value and sys.stdout is None:
      raise data.DataError('stdout is closed: give --output=FILE, or leave stdout open')
    sentences = (data.read_lines(_INPUT.value) if _INPUT.value else
                 data.decode_lines(sys.stdin.buffer.read(), '<stdin>'))
    translator, params, _, steps = translate.load(
        workdirs if len(workdirs) > 1 else workdirs[0], **_DECODING.values(), config=config,
        nbest=_NBEST.value or 1, sampling=drawing)
    began = time.time()
    hypotheses = translator.hypotheses(params, translate.tag_sources(pair, sentences),
                                       progress=True)
    logging.info('%d sentences in %.1f s with checkpoints %s', len(sentences),
                 time.time() - began, steps)
    if _NBEST.value or _NUM_SAMPLES.value:
      text = table(hypotheses)
    else:
      text = ''.join((of_line[0].text if of_line else '') + '\n' for of_line in hypotheses)
    if _OUTPUT.value:
      files.write_atomically(_OUTPUT.value, text)
  except (config_lib.ConfigError, data.DataError, checkpoints.CheckpointError,
          files.DirectoryError, marian.MarianError) as error:
    sys.exit(f'translate.py: {error}')
  if not _OUTPUT.value:
    sys.stdout.write(text)


if __name__ == '__main__':
  commands.run(main, 'translate.py')
