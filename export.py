r"""Exports a trained run for Hugging Face transformers or CTranslate2.

  python export.py --workdir=DIR --output_dir=OUT [--average_last=N] [--up_to_step=S]
      [--format=transformers|ctranslate2] [--quantization=int8] [--scores=D/scores.json]

--format=transformers (the default) writes a Marian directory that
`transformers.MarianMTModel.from_pretrained(OUT)`, `MarianTokenizer.from_pretrained(OUT)` and
`pipeline('translation', model=OUT)` load: config.json, model.safetensors, generation_config.json
(the run's beam size and longest output), source.spm, target.spm, vocab.json,
tokenizer_config.json, and a README.md model card with the BLEU of the exported checkpoints
(the run's closing evaluation, and each eval.py scores.json given by --scores that scored the
same checkpoints). --format=ctranslate2 writes a CTranslate2 model directory (model.bin, the
vocabularies, config.json; float32, or --quantization=int8) and the same model card.

OUT must be new or empty; it appears whole or not at all.
"""

if __name__ == '__main__':  # first: a Ctrl-C in the imports below (seconds) ends in one line
  from transformer import interrupts
  interrupts.end_at_once('export.py')

import functools
import json
import os
import sys

from absl import app, flags
from etils import epath

from transformer import checkpoints, commands, data, export, files, marian
from transformer import config as config_lib
from transformer import stored_config

_WORKDIR = flags.DEFINE_string('workdir', None, 'The train.py workdir to export.')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where the exported model goes: a new or '
                                  'empty directory.')
_FORMAT = flags.DEFINE_enum('format', 'transformers', export.FORMATS, 'transformers: a Hugging '
                            'Face Marian directory; ctranslate2: a CTranslate2 model directory.')
_QUANTIZATION = flags.DEFINE_enum('quantization', 'float32', export.QUANTIZATIONS,
                                  'CTranslate2 weights (--format=ctranslate2 only).')
_AVERAGE_LAST = flags.DEFINE_integer('average_last', None, 'Average the last N checkpoints '
                                     "(default: the config's average_last).", lower_bound=1)
_UP_TO_STEP = flags.DEFINE_integer('up_to_step', None, 'Average the last checkpoints at or '
                                   'before this step (default: the newest).', lower_bound=0)
_SCORES = flags.DEFINE_multi_string('scores', [], 'An eval.py scores.json of the same '
                                    'checkpoints, for the model card; repeatable.')
flags.mark_flags_as_required(['workdir', 'output_dir'])


class ExportError(ValueError):
  """A flag or file export.py cannot use; the message names it."""


def check_output_dir(path: str):
  """Refuses an OUT that holds files or cannot be made, before any work."""
  if files.is_remote(path):
    raise ExportError(f'--output_dir={path}: give a local directory (copy it to the bucket or '
                      'the Hub after)')
  if os.path.isdir(path) and os.listdir(path):
    raise ExportError(f'--output_dir={path} is not empty; give a new or empty directory')


def evaluations(workdir: str, steps: list[int], score_files: list[str]) -> list[dict]:
  """BLEU rows of the checkpoints `steps`: the run's own (metrics.jsonl), then each scores.json."""
  rows = []
  metrics = epath.Path(workdir, 'metrics.jsonl')
  if metrics.exists():
    for line in metrics.read_text(encoding='utf-8').splitlines():
      try:
        row = json.loads(line)
      except ValueError:  # a blank or cut line: not a score
        continue
      if isinstance(row, dict) and row.get('checkpoint_steps') == steps and 'sacrebleu' in row:
        rows.append({'evaluated': f'{row["split"]} (train.py)', **row})
  for path in score_files:
    try:
      scores = json.loads(open(path, 'rb').read().decode('utf-8'))
    except (OSError, ValueError) as error:
      raise ExportError(f'--scores={path}: not an eval.py scores.json ({error})') from None
    if not isinstance(scores, dict) or 'sacrebleu' not in scores:
      raise ExportError(f'--scores={path}: not an eval.py scores.json (no "sacrebleu")')
    if scores.get('checkpoint_steps') != steps:
      raise ExportError(f'--scores={path} scored checkpoints {scores.get("checkpoint_steps")}, '
                        f'not the exported {steps}; pass the --average_last and --up_to_step '
                        'eval.py had')
    rows.append(scores)
  return rows


def model_card(config, steps: list[int], rows: list[dict], format_name: str,
               quantization: str) -> str:
  """README.md: what the model is, how it was trained and scored, and how to use it."""
  model = config.model
  what = ('A Hugging Face Marian model (`MarianMTModel`)' if format_name == 'transformers' else
          f'A CTranslate2 model ({quantization} weights)')
  library = 'transformers' if format_name == 'transformers' else 'ctranslate2'
  lines = [
      '---', 'language:', f'- {config.source_lang}', f'- {config.target_lang}',
      'tags:', '- translation', f'library_name: {library}', 'pipeline_tag: translation', '---',
      '', f'# Transformer {config.source_lang}-{config.target_lang}', '',
      f'{what}, trained with the JAX/Flax Transformer of "Attention Is All You Need" '
      f'(transformer-nmt).', '',
      '## Training', '',
      f'- data: `{config.dataset}`, {config.source_lang} -> {config.target_lang}',
      f'- model: {model.num_encoder_layers}+{model.num_decoder_layers} layers, d_model '
      f'{model.d_model}, d_ff {model.d_ff}, {model.num_heads} heads, {config.vocab_size}-piece '
      f'joint SentencePiece vocabulary, {model.activation}, LayerNorm epsilon '
      f'{model.layer_norm_epsilon}',
      f'- {config.num_train_steps} steps of ~{config.tokens_per_batch} source tokens, seed '
      f'{config.seed}; checkpoints {steps} averaged', '',
      '## BLEU', '',
  ]
  if rows:
    lines += ['| evaluated | sacreBLEU | paper BLEU | beam | alpha |',
              '| --- | --- | --- | --- | --- |']
    lines += [f'| {row.get("evaluated", "")} | {row["sacrebleu"]:.2f} | '
              f'{row.get("bleu_paper", float("nan")):.2f} | {row.get("beam_size", config.beam_size)} '
              f'| {row.get("alpha", config.alpha)} |' for row in rows]
  else:
    lines.append('Not scored: run eval.py on the same checkpoints and export again with --scores.')
  lines += [
      '', 'Scored with this codebase\'s beam search: its length penalty is GNMT\'s '
      '((5 + length) / 6)^alpha, where transformers and CTranslate2 divide by length^alpha, so '
      'beam search there can choose other translations when alpha > 0.', '',
      '## Use', '',
  ]
  if format_name == 'transformers':
    lines += ['```python', 'from transformers import pipeline',
              "translate = pipeline('translation', model='PATH')",
              "print(translate('A man is riding a bicycle.')[0]['translation_text'])", '```']
  else:
    lines += ['```python', 'import ctranslate2, sentencepiece',
              "translator = ctranslate2.Translator('PATH')",
              "spm = sentencepiece.SentencePieceProcessor(model_file='PATH/source.spm')",
              "pieces = spm.encode('A man is riding a bicycle.', out_type=str) + ['</s>']",
              f'result = translator.translate_batch([pieces], beam_size={config.beam_size})',
              "target = sentencepiece.SentencePieceProcessor(model_file='PATH/target.spm')",
              'print(target.decode(result[0].hypotheses[0]))', '```']
  lines += ['', '## Made by', '', '```sh', 'python export.py ' + ' '.join(sys.argv[1:]), '```', '']
  return '\n'.join(lines)


def write(params, config, vocab, card: str, directory: str):
  """The flags' format of the run's `params` in `directory`, with the model `card`."""
  export.write(params, config, vocab, directory, _FORMAT.value, _QUANTIZATION.value)
  with open(os.path.join(directory, 'README.md'), 'w', encoding='utf-8') as f:
    f.write(card)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  if _QUANTIZATION.value != 'float32' and _FORMAT.value != 'ctranslate2':
    sys.exit('export.py: --quantization is for --format=ctranslate2; transformers gets float32')
  try:
    config = stored_config.load_workdir_config(_WORKDIR.value)
    if config.pairs:
      # MarianTokenizer spells a tag after a lone word-start piece, which the run never read.
      raise ExportError(f'{_WORKDIR.value} translates several pairs (config.pairs='
                        f'{config.pairs!r}), with source tags that Marian\'s tokenizer splits '
                        'otherwise: only runs of one pair are exported')
    marian.check_exportable(dict(config.model))
    check_output_dir(_OUTPUT_DIR.value)
    commands.set_up_jax(config, _WORKDIR.value)
    with files.made_for_the_block(_OUTPUT_DIR.value, '--output_dir'):  # gone if left empty
      files.check_writable(os.path.join(_OUTPUT_DIR.value, 'config.json'), '--output_dir')
      vocab = data.load_vocabulary(config, _WORKDIR.value)
      params, steps = checkpoints.load_params(_WORKDIR.value, config, _AVERAGE_LAST.value,
                                              _UP_TO_STEP.value)
      card = model_card(config, steps, evaluations(_WORKDIR.value, steps, _SCORES.value),
                        _FORMAT.value, _QUANTIZATION.value)
      # OUT appears whole or not at all.
      files.write_directory(_OUTPUT_DIR.value,
                            functools.partial(write, params, config, vocab, card))
  except (config_lib.ConfigError, data.DataError, checkpoints.CheckpointError,
          files.DirectoryError, marian.MarianError, ExportError) as error:
    sys.exit(f'export.py: {error}')
  print(f'exported checkpoints {steps} of {_WORKDIR.value} to {_OUTPUT_DIR.value} '
        f'({_FORMAT.value})')


if __name__ == '__main__':
  commands.run(main, 'export.py')
