r"""Attention heatmaps of one translation (transformer/plots.py, `attention_figures`).

  python plot_attention.py --workdir=DIR --sentence="A man is riding a bicycle."
      [--output_dir=D] [--average_last=N] [--up_to_step=S] [--beam_size=B] [--alpha=A]

Writes D/encoder_self_attention.png, D/decoder_self_attention.png and D/cross_attention.png
(default D: DIR/attention).
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('plot_attention.py')

import os
import sys

from absl import app, flags

from transformer import checkpoints, commands, data, files, plots, translate
from transformer import config as config_lib
from transformer import stored_config

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir (config.json, vocab/, '
                               'checkpoints/).')
_SENTENCE = flags.DEFINE_string('sentence', None, 'The source sentence to translate and picture.')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where the PNGs go (default: '
                                  '<workdir>/attention).')
_DECODING = translate.DecodingFlags()
flags.adopt_module_key_flags(translate)  # --helpshort lists them
flags.mark_flags_as_required(['workdir', 'sentence'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  if not _SENTENCE.value.strip():
    sys.exit('plot_attention.py: --sentence is empty; give the sentence to translate')
  output_dir = _OUTPUT_DIR.value or os.path.join(_WORKDIR.value, 'attention')
  try:
    # A wrong --workdir fails before output_dir.
    commands.set_up_jax(stored_config.load_workdir_config(_WORKDIR.value), _WORKDIR.value)
    with files.made_for_the_block(output_dir, '--output_dir'):
      paths = [os.path.join(output_dir, f'{name}.png') for name in plots.KINDS]
      for path in paths:
        files.check_writable(path, '--output_dir')
      translation, figures = plots.attention_figures(_WORKDIR.value, _SENTENCE.value,
                                                     **_DECODING.values())
      for name, path in zip(plots.KINDS, paths):
        plots.save(figures[name], path)
  except (config_lib.ConfigError, data.DataError, checkpoints.CheckpointError,
          files.DirectoryError) as error:
    sys.exit(f'plot_attention.py: {error}')
  print(f'translation: {translation}')
  print('\n'.join(f'wrote {path}' for path in paths))


if __name__ == '__main__':
  commands.run(main, 'plot_attention.py')
