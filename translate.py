r"""Translates sentences with a trained run: one sentence per line in, one translation per line out.

  python translate.py --workdir=DIR [--input=FILE] [--output=FILE] [--average_last=N]
      [--up_to_step=S] [--beam_size=B] [--alpha=A]

reads --input (default: stdin) and writes --output (default: stdout), with the mean of the run's
last average_last checkpoints and its beam search settings unless the flags say otherwise.
--workdir may be a Hugging Face Marian directory instead (an OPUS-MT model, an export.py output):
its weights as they are, with its generation_config.json's beam size and length penalty.
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('translate.py')

import sys
import time

from absl import app, flags, logging

from configs import default
from transformer import checkpoints, commands, data, files, marian, translate
from transformer import config as config_lib

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir (config.json, vocab/, '
                               'checkpoints/), or a Hugging Face Marian directory.')
_INPUT = flags.DEFINE_string('input', None, 'Sentences, one per line (default: stdin).')
_OUTPUT = flags.DEFINE_string('output', None, 'Where translations go (default: stdout).')
_DECODING = translate.DecodingFlags()
flags.adopt_module_key_flags(translate)  # --helpshort lists them
flags.mark_flag_as_required('workdir')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    # A wrong --workdir or --output fails before stdin is read.
    config = config_lib.load_workdir_config(_WORKDIR.value, default.get_config)
    commands.set_up_jax(config, _WORKDIR.value)
    if _OUTPUT.value:
      files.check_writable(_OUTPUT.value, f'--output={_OUTPUT.value}')
    # As bytes: a line that is not UTF-8 gets its number in a DataError, not a surrogate escape.
    if not _INPUT.value and sys.stdin is None:
      raise data.DataError('stdin is closed: pipe the sentences in, or give --input=FILE')
    if not _OUTPUT.value and sys.stdout is None:
      raise data.DataError('stdout is closed: give --output=FILE, or leave stdout open')
    sentences = (data.read_lines(_INPUT.value) if _INPUT.value else
                 data.decode_lines(sys.stdin.buffer.read(), '<stdin>'))
    translator, params, _, steps = translate.load(_WORKDIR.value, **_DECODING.values(),
                                                  config=config)
    began = time.time()
    translations = translator.translate(params, sentences, progress=True)
    logging.info('%d sentences in %.1f s with checkpoints %s', len(sentences),
                 time.time() - began, steps)
    text = ''.join(t + '\n' for t in translations)
    if _OUTPUT.value:
      files.write_atomically(_OUTPUT.value, text)
  except (config_lib.ConfigError, data.DataError, checkpoints.CheckpointError,
          files.DirectoryError, marian.MarianError) as error:
    sys.exit(f'translate.py: {error}')
  if not _OUTPUT.value:
    sys.stdout.write(text)


if __name__ == '__main__':
  commands.run(main, 'translate.py')
