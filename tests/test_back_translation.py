"""docs/back_translation.md's recipe, its shell block as written, at configs/tiny.py's size on
generated files named as Multi30k's."""

import gzip
import json
import os
import re
import string
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_script
from transformer import stored_config
from transformer import data

pytestmark = pytest.mark.slow  # each test trains, compiles or runs a command

RECIPE = os.path.join(ROOT, 'docs', 'back_translation.md')
PREFIXES = {'train': 'train', 'validation': 'val', 'test': 'test_2016_flickr'}
SIZES = {'train': 2000, 'validation': 200, 'test': 200}


def generated_pairs() -> dict[str, tuple[list[str], list[str]]]:
  """{split: (English, German)}: sentences of 2-7 of 300 words over 26 letters, each German word
  the English one's through a fixed permutation. Words enough for a 700-piece vocabulary, which
  leaves room for the stray characters a 100-step model's samples hold (SentencePiece needs a
  piece for each character but the rarest)."""
  rng = np.random.default_rng(0)
  words = sorted({''.join(rng.choice(list(string.ascii_lowercase), rng.integers(2, 7)))
                  for _ in range(400)})[:300]
  german = [words[i] for i in rng.permutation(len(words))]
  frequencies = 1 / np.arange(1, len(words) + 1)
  pairs = {}
  for split, size in SIZES.items():
    sentences = [rng.choice(len(words), rng.integers(2, 8), p=frequencies / frequencies.sum())
                 for _ in range(size)]
    pairs[split] = ([' '.join(words[i] for i in s) for s in sentences],
                    [' '.join(german[i] for i in s) for s in sentences])
  return pairs


def recipe_block() -> str:
  """The shell block under '## The recipe'."""
  with open(RECIPE, encoding='utf-8') as f:
    text = f.read()
  return re.search(r'## The recipe\n\n```sh\n(.*?)```', text, re.DOTALL).group(1)


def test_the_back_translation_recipe_runs_as_written(tmp_path):
  multi30k = tmp_path / 'multi30k'
  multi30k.mkdir()
  pairs = generated_pairs()
  for split, prefix in PREFIXES.items():
    for lang, lines in zip(('en', 'de'), pairs[split]):
      with gzip.open(multi30k / f'{prefix}.{lang}.gz', 'wt', encoding='utf-8') as f:
        f.writelines(line + '\n' for line in lines)
  out = tmp_path / 'out'
  env = {**os.environ, 'DATA': str(multi30k), 'CONFIG': 'configs/tiny.py', 'KEEP': '1000',
         # No validation loss on the way, no BLEU at the end: the recipe's eval.py scores.
         'OUT': str(out), 'TRAIN_FLAGS': '--config.vocab_size=700 --config.eval_every_steps=0 '
                                         '--config.final_bleu_splits=',
         'PATH': f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}',
         'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  result = subprocess.run(['bash', '-euo', 'pipefail', '-c', recipe_block()], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
  assert result.returncode == 0, result.stderr[-4000:]

  monolingual = (out / 'data' / 'monolingual.de').read_text(encoding='utf-8').splitlines()
  synthetic_english = (out / 'data' / 'synthetic.en').read_text(encoding='utf-8').splitlines()
  assert monolingual == pairs['train'][1][1000:]
  assert len(synthetic_english) == len(monolingual) == 1000
  union = {lang: (out / 'data' / f'union.{lang}').read_text(encoding='utf-8').splitlines()
           for lang in ('en', 'de')}
  assert union['en'][:1000] == pairs['train'][0][:1000]
  assert union['de'][:1000] == pairs['train'][1][:1000]
  drawn = [(english, german) for english, german in zip(synthetic_english, monolingual) if english]
  assert len(drawn) > 900  # a few draws end at once: those pairs are left out
  assert list(zip(union['en'][1000:], union['de'][1000:])) == [
      (f'<BT> {english}', german) for english, german in drawn]
  # Drawn again the same for the seed.
  again = run_script('translate.py', f'--workdir={out / "de-en"}',
                     f'--input={out / "data" / "monolingual.de"}', '--sampling=topk', '--seed=0')
  assert again.stdout.splitlines() == synthetic_english
  tags = {}
  for run in ('en-de_back_translated', 'en-de_parallel'):
    config = stored_config.load_workdir_config(str(out / run))
    tags[run] = data.load_vocabulary(config, str(out / run)).tags
    scores = json.loads((out / f'eval_{run}' / 'scores.json').read_text())
    # The test split, by the average of the run's last two checkpoints (configs/tiny.py's).
    assert (scores['num_sentences'], scores['checkpoint_steps']) == (SIZES['test'], [50, 100])
    assert len((out / f'eval_{run}' / 'hypotheses.txt').read_text().splitlines()) == SIZES['test']
  assert list(tags['en-de_back_translated']) == ['<BT>']
  assert tags['en-de_parallel'] == {}
