r"""Evaluates a trained run: translates a split or files and scores BLEU.

  python eval.py --workdir=DIR [--split=test] [--source_file=F --reference_file=R]
      [--average_last=N] [--beam_size=B] [--alpha=A] --output_dir=D

writes D/hypotheses.txt and D/scores.json.
"""

import sys

from absl import app, flags

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training directory (config.json, checkpoints/).')
_SPLIT = flags.DEFINE_string('split', 'test', 'Dataset split to translate: test or validation.')
_SOURCE_FILE = flags.DEFINE_string('source_file', None, 'Translate this file instead of a split.')
_REFERENCE_FILE = flags.DEFINE_string('reference_file', None, 'References for --source_file.')
_AVERAGE_LAST = flags.DEFINE_integer('average_last', None,
                                     'Average the last N checkpoints (default: the config\'s).')
_BEAM_SIZE = flags.DEFINE_integer('beam_size', None, 'Beam size (default: the config\'s).')
_ALPHA = flags.DEFINE_float('alpha', None, 'Length penalty alpha (default: the config\'s).')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where hypotheses.txt and scores.json go.')
flags.mark_flags_as_required(['workdir', 'output_dir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  sys.exit('eval.py: evaluation is not implemented yet.')


if __name__ == '__main__':
  app.run(main)
