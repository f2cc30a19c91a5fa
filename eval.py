r"""Evaluates a trained run: translates a split or a file and scores both BLEUs.

  python eval.py --workdir=DIR [--split=test] [--source_file=F --reference_file=R]
      [--average_last=N] [--up_to_step=S] [--beam_size=B] [--alpha=A] [--target_lang=LANG]
      --output_dir=D

writes D/hypotheses.txt (one translation per line, input order) and D/scores.json: `sacrebleu` and
`sacrebleu_signature` (detokenized, 13a), `bleu_paper` (Moses-tokenized, compound-split, as the
paper's tables) and `bleu_paper_variant` (what that did), `bleu_lowercased` (lowercased and
Moses-tokenized, as the multimodal-translation literature scores Multi30k) and
`bleu_lowercased_variant`, `chrf` and `chrf_signature` (sacreBLEU's chrF2), `num_sentences`,
`checkpoint_steps`,
the decoding settings, `sentences_per_sec` after compilation and `compile_secs`.

A run of several language pairs (config.pairs) is scored on one: --target_lang names it (the
split's pair into that language; each source starts with its tag).

--workdir may be a Hugging Face Marian directory instead (an OPUS-MT model, an export.py output):
its weights as they are, its generation_config.json's beam size and length penalty, the
--source_file and --reference_file given, scored in the target language of its model card.
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('eval.py')

import json
import os
import sys
import time

from absl import app, flags, logging

from configs import default
from transformer import bleu, checkpoints, commands, data, files, languages, marian, translate
from transformer import config as config_lib
from transformer import stored_config

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training directory (config.json, checkpoints/), '
                               'or a Hugging Face Marian directory.')
_SPLIT = flags.DEFINE_string('split', 'test', 'Dataset split to translate: test or validation.')
_SOURCE_FILE = flags.DEFINE_string('source_file', None, 'Translate this file instead of a split.')
_REFERENCE_FILE = flags.DEFINE_string('reference_file', None, 'References for --source_file.')
_DECODING = translate.DecodingFlags()
flags.adopt_module_key_flags(translate)  # --helpshort lists them
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where hypotheses.txt and scores.json go.')
flags.mark_flags_as_required(['workdir', 'output_dir'])


class EvalError(ValueError):
  """Bad evaluation input; the message names the file or flag."""


def evaluation_texts(config, pair) -> tuple[list[str], list[str], str]:
  """(sources, references, what they are) from the flags; those of `pair` of a multilingual run,
  its sources tagged."""
  if (_SOURCE_FILE.value is None) != (_REFERENCE_FILE.value is None):
    raise EvalError('--source_file and --reference_file go together')
  if marian.is_marian_directory(_WORKDIR.value):
    if _SOURCE_FILE.value is None:
      raise EvalError(f'{_WORKDIR.value} is a Hugging Face Marian model, which names no dataset: '
                      'give --source_file and --reference_file')
    if marian.card_languages(_WORKDIR.value) is None:
      raise EvalError(f'{_WORKDIR.value}/README.md names no language pair, and BLEU tokenizes in '
                      'the target language: add "language: [SOURCE, TARGET]" (e.g. [en, de]) '
                      'between "---" lines at its top')
  if _SOURCE_FILE.value is None:
    into = [f'{source}-{target}' for source, target in languages.pairs(config)
            if pair and target == pair[1]]
    if len(into) > 1:
      raise EvalError(f'--target_lang={pair[1]}: the run translates {" and ".join(into)}, and a '
                      'split holds each: give its --source_file and --reference_file instead')
    with stored_config.fixes_in_run_config(_WORKDIR.value):
      sources, references = data.split_texts(config, _SPLIT.value, pair)
    return sources, references, f'{config.dataset} {_SPLIT.value}' + (
        f' {"-".join(pair)}' if pair else '')
  sources = translate.tag_sources(pair, data.read_lines(_SOURCE_FILE.value))
  references = data.read_lines(_REFERENCE_FILE.value)
  if len(sources) != len(references):
    raise EvalError(f'{_SOURCE_FILE.value} has {len(sources)} lines but {_REFERENCE_FILE.value} '
                    f'has {len(references)}: they must be aligned line by line')
  if not sources:
    raise EvalError(f'{_SOURCE_FILE.value} is empty: give one sentence per line to evaluate')
  return sources, references, _SOURCE_FILE.value


def evaluate(config, sources: list[str], references: list[str], name: str,
             target_lang: str | None) -> tuple[list[str], dict]:
  """(the hypotheses, scores.json's dict) of the run in --workdir, whose config is `config`, on
  `sources`, in `target_lang` (None: the run's)."""
  translator, params, config, steps = translate.load(_WORKDIR.value, **_DECODING.values(),
                                                     config=config)
  began = time.time()
  hypotheses = translator.translate(params, sources, progress=True)
  seconds = time.time() - began
  language = target_lang or config.target_lang
  sacrebleu_score, signature = bleu.sacrebleu_score(hypotheses, references, language)
  compound_split = config_lib.compound_split(config, language)
  chrf, chrf_signature = bleu.chrf_score(hypotheses, references)
  return hypotheses, {
      'sacrebleu': sacrebleu_score,
      'sacrebleu_signature': signature,
      'bleu_paper': bleu.paper_bleu(hypotheses, references, language, compound_split),
      'bleu_paper_variant': bleu.paper_variant(compound_split),
      'bleu_lowercased': bleu.lowercase_bleu(hypotheses, references, language),
      'bleu_lowercased_variant': bleu.lowercase_variant(language),
      'chrf': chrf,
      'chrf_signature': chrf_signature,
      'num_sentences': len(sources),
      'checkpoint_steps': steps,
      'evaluated': name,
      'beam_size': translator.beam_size,
      'alpha': translator.alpha,
      # Compilation (once per batch shape, before the first sentence) is timed apart.
      'sentences_per_sec': len(sources) / max(seconds - translator.compile_secs, 1e-9),
      'compile_secs': translator.compile_secs,
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  outputs = [os.path.join(_OUTPUT_DIR.value, name) for name in ('hypotheses.txt', 'scores.json')]
  try:
    # The texts and the outputs first: bad ones fail before the model is loaded.
    run_config = stored_config.load_workdir_config(_WORKDIR.value, default.get_config)
    commands.set_up_jax(run_config, _WORKDIR.value)
    pair = _DECODING.pair(run_config)
    sources, references, name = evaluation_texts(run_config, pair)
    with files.made_for_the_block(_OUTPUT_DIR.value, '--output_dir'):
      for path in outputs:
        files.check_writable(path, '--output_dir')
      hypotheses, scores = evaluate(run_config, sources, references, name,
                                    pair and pair[1])
      files.write_atomically(outputs[0], ''.join(h + '\n' for h in hypotheses))
      files.write_atomically(outputs[1], json.dumps(scores, indent=2) + '\n')
  except (config_lib.ConfigError, data.DataError, checkpoints.CheckpointError,
          files.DirectoryError, marian.MarianError, EvalError) as error:
    sys.exit(f'eval.py: {error}')
  logging.info('sacreBLEU signature: %s', scores['sacrebleu_signature'])
  print(f'{name}: sacreBLEU {scores["sacrebleu"]:.2f} | paper BLEU {scores["bleu_paper"]:.2f} | '
        f'lowercased BLEU {scores["bleu_lowercased"]:.2f} | chrF {scores["chrf"]:.2f} | '
        f'{len(sources)} sentences | {scores["sentences_per_sec"]:.1f} sentences/s after '
        f'{scores["compile_secs"]:.1f} s of compilation | '
        f'checkpoints {scores["checkpoint_steps"] or "- (a Marian model)"}')


if __name__ == '__main__':
  commands.run(main, 'eval.py')
