r"""Scores given translations: the log-probability of each target line given its source line.

  python score.py --workdir=DIR [--workdir=DIR2 ...] --source_file=S --target_file=T
      [--output=F] [--average_last=N] [--up_to_step=S] [--target_lang=LANG]

writes (--output, default: stdout) tab-separated rows under a header: `line`, `log_prob` (natural
log, summed over the target's tokens, EOS included), `tokens` and `log_prob_per_token`, from one
teacher-forced pass over each pair, with the checkpoints eval.py averages; several --workdir score
with their ensemble (the renormalized mean of their log-probabilities, as translate.py decodes).
For reranking n-best lists, filtering noisy pairs, or forced decoding. A run of several language
pairs (config.pairs) scores translations into --target_lang.
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('score.py')

import math
import sys

from absl import app, flags, logging

from configs import default
from transformer import checkpoints, commands, data, files, marian, translate
from transformer import config as config_lib
from transformer import stored_config

_WORKDIR = flags.DEFINE_multi_string(
    'workdir', None, 'A train.py workdir, or a Hugging Face Marian directory; several: their '
    'ensemble.')
_SOURCE_FILE = flags.DEFINE_string('source_file', None, 'Source sentences, one per line.')
_TARGET_FILE = flags.DEFINE_string('target_file', None, 'Their translations, line by line.')
_OUTPUT = flags.DEFINE_string('output', None, 'Where the scores go (default: stdout).')
_CHECKPOINTS = translate.DecodingFlags(search=False)
flags.adopt_module_key_flags(translate)  # --helpshort lists them
flags.mark_flags_as_required(['workdir', 'source_file', 'target_file'])

TABLE_HEADER = 'line\tlog_prob\ttokens\tlog_prob_per_token\n'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    workdirs = _WORKDIR.value
    config = stored_config.load_workdir_config(workdirs[0], default.get_config)
    commands.set_up_jax(config, workdirs[0])
    pair = _CHECKPOINTS.pair(config)
    if _OUTPUT.value:
      files.check_writable(_OUTPUT.value, f'--output={_OUTPUT.value}')
    sources, targets = data.read_lines(_SOURCE_FILE.value), data.read_lines(_TARGET_FILE.value)
    if len(sources) != len(targets):
      raise data.DataError(f'{_SOURCE_FILE.value} has {len(sources)} lines but '
                           f'{_TARGET_FILE.value} has {len(targets)}: they must be aligned line '
                           'by line')
    translator, params, _, steps = translate.load(
        workdirs if len(workdirs) > 1 else workdirs[0], **_CHECKPOINTS.values(), config=config)
    scores = translator.score(params, translate.tag_sources(pair, sources), targets,
                              progress=True)
    text = TABLE_HEADER + ''.join(f'{line}\t{log_prob:.4f}\t{tokens}\t{log_prob / tokens:.4f}\n'
                                  for line, (log_prob, tokens) in enumerate(scores, 1))
    if _OUTPUT.value:
      files.write_atomically(_OUTPUT.value, text)
  except (config_lib.ConfigError, data.DataError, checkpoints.CheckpointError,
          files.DirectoryError, marian.MarianError) as error:
    sys.exit(f'score.py: {error}')
  if scores:
    per_token = sum(log_prob for log_prob, _ in scores) / sum(tokens for _, tokens in scores)
    logging.info('%d pairs with checkpoints %s: %.4f nats per target token (perplexity %.2f)',
                 len(scores), steps, per_token, math.exp(-per_token))
  if not _OUTPUT.value:
    sys.stdout.write(text)


if __name__ == '__main__':
  commands.run(main, 'score.py')
