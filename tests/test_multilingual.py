"""One model for several language pairs (config.pairs): the tagged data, the vocabulary's tags, the
evaluation of each pair, and the commands' --target_lang, on a tiny run of two generated tasks."""

import gzip
import json

import numpy as np
import pytest
import sacrebleu

from configs import multi30k, tiny
from conftest import error_line, run_script, train_in_process
from transformer import config as config_lib
from transformer import data, languages, plots
from transformer.data import synthetic

# Two tasks on the synthetic sources ('xx'): copy them ('cp'), or spell each letter backwards
# through the alphabet ('up': a <-> h, b <-> g, ...).
TASKS = {'cp': lambda text: text, 'up': lambda text: text.translate(str.maketrans('abcdefgh',
                                                                                   'hgfedcba'))}


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  """Files '<split>.<lang>.gz' of the synthetic sources ('xx') and their two tasks."""
  path = tmp_path_factory.mktemp('tasks')
  for split in ('train', 'validation', 'test'):
    sources = synthetic.pairs(split)[0]
    for lang, text_of in {'xx': lambda text: text, **TASKS}.items():
      with gzip.open(path / f'{split}.{lang}.gz', 'wt', encoding='utf-8') as f:
        f.writelines(text_of(source) + '\n' for source in sources)
  return path


def tasks_config(text_dir, pairs: str = 'xx-cp,xx-up'):
  config = tiny.get_config()
  config.update(dataset='text', source_lang='xx', target_lang='cp', pairs=pairs,
                **{f'{split}_files': str(text_dir / f'{split}.{{lang}}.gz')
                   for split in ('train', 'validation', 'test')})
  return config


@pytest.fixture(scope='module')
def tasks_run(text_dir, tmp_path_factory):
  """configs/tiny.py trained 200 steps on both tasks, tagged; validation loss and BLEU of each."""
  path = str(tmp_path_factory.mktemp('tasks_run'))
  config = tasks_config(text_dir)
  train_in_process(path, **{key: config[key] for key in (
      'dataset', 'source_lang', 'target_lang', 'pairs', 'train_files', 'validation_files',
      'test_files')}, num_train_steps=200, eval_every_steps=100, bleu_every_steps=200,
                   final_bleu_splits='', warmup_steps=50, lr_scale=1.0)
  return path


def test_the_mixed_split_holds_each_pair_in_turn_its_sources_tagged(text_dir):
  config = config_lib.validate(tasks_config(text_dir))
  mixed = data.load_split(config, 'validation')
  sources = synthetic.pairs('validation')[0]
  size = len(sources)
  assert len(mixed) == 2 * size
  texts = mixed.texts([0, size - 1, size, 2 * size - 1])
  assert texts == ([f'<2cp> {sources[0]}', f'<2cp> {sources[-1]}', f'<2up> {sources[0]}',
                    f'<2up> {sources[-1]}'],
                   [sources[0], sources[-1], TASKS['up'](sources[0]), TASKS['up'](sources[-1])])
  # Read in any order, as the batcher does.
  assert mixed.texts([size, 0])[0] == [f'<2up> {sources[0]}', f'<2cp> {sources[0]}']
  assert data.split_texts(config, 'validation', ('xx', 'up')) == (
      [f'<2up> {source}' for source in sources], [TASKS['up'](source) for source in sources])
  one_pair = config_lib.validate(tasks_config(text_dir, pairs=''))
  assert data.split_texts(one_pair, 'validation') == (sources, sources)
  digests = {data.load_split(c, 'validation', pair).digest for c, pair in (
      (config, None), (config, ('xx', 'cp')), (config, ('xx', 'up')), (one_pair, None))}
  assert len(digests) == 4  # what is stored from each is kept apart


def test_each_tag_is_one_piece_read_before_the_sentence(text_dir, tmp_path):
  config = config_lib.validate(tasks_config(text_dir))
  vocab = data.load_or_train_vocabulary(config, str(tmp_path))
  assert sorted(vocab.tags) == ['<2cp>', '<2up>']
  sentence = 'abc de fgh'
  assert vocab.encode_batch([f'<2up> {sentence}', sentence], add_eos=True) == [
      [vocab.tags['<2up>'], *vocab.encode(sentence), data.EOS_ID],
      [*vocab.encode(sentence), data.EOS_ID]]
  assert vocab.decode(vocab.encode(f'<2cp> {sentence}')) == f'<2cp> {sentence}'  # round trip
  untagged = config_lib.validate(tasks_config(text_dir, pairs=''))
  data.load_or_train_vocabulary(untagged, str(tmp_path / 'untagged'))
  with pytest.raises(data.DataError, match=r"has no piece <2cp> \(config.pairs='xx-cp,xx-up', "
                     r"config.source_tags=''\): it is the vocabulary of another run"):
    data.load_vocabulary(config, str(tmp_path / 'untagged'))


@pytest.mark.parametrize('pairs,message', [
    ('xx-cp', 'a multilingual model needs two or more different pairs'),
    ('xx-cp,xx-cp', 'a multilingual model needs two or more different pairs'),
    ('xx-cp,xxup', "'xxup' is not a language pair"),
    ('xx-cp,up-up', "'up-up' translates a language into itself"),
    ('xx-up,xx-cp', 'its first pair is xx-up but config.source_lang-config.target_lang is xx-cp'),
])
def test_bad_pairs_get_one_line(text_dir, pairs, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(tasks_config(text_dir, pairs))


@pytest.mark.parametrize('tags,message', [
    ('BT', "must be comma-separated tags such as '<BT>'"),
    ('<BT>,<B T>', "must be comma-separated tags such as '<BT>'"),
    ('<BT>,<2up>', '<2up> is the tag of a target language of config.pairs already'),
])
def test_bad_source_tags_get_one_line(text_dir, tags, message):
  config = tasks_config(text_dir)
  config.source_tags = tags
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config)


def test_multi30k_takes_pairs_joined_by_plus():
  config = config_lib.validate(multi30k.get_config('en-de+en-fr'))
  assert (config.pairs, config.source_lang, config.target_lang) == ('en-de,en-fr', 'en', 'de')
  assert languages.pairs(config) == [('en', 'de'), ('en', 'fr')]
  config.pairs = 'en-de,en-es'
  with pytest.raises(config_lib.ConfigError, match="'en-es': Multi30k has en, de, fr only"):
    config_lib.validate(config)


@pytest.mark.slow
def test_training_evaluates_each_pair_apart_and_plots_them(tasks_run):
  rows = [json.loads(line) for line in open(f'{tasks_run}/metrics.jsonl', encoding='utf-8')]
  evaluated = sorted((row['step'], row['pair'], 'sacrebleu' in row) for row in rows
                     if row.get('split') == 'validation')
  assert evaluated == [(100, 'xx-cp', False), (100, 'xx-up', False), (200, 'xx-cp', False),
                       (200, 'xx-cp', True), (200, 'xx-up', False), (200, 'xx-up', True)]
  losses = {pair: plots.series(rows, 'validation', 'loss', pair=pair) for pair in ('xx-cp',
                                                                                    'xx-up')}
  assert [step for step, _, _ in losses['xx-cp']] == [100, 200]
  assert losses['xx-cp'] != losses['xx-up']
  assert plots.series(rows, 'validation', 'loss') == []  # no row without its pair
  figure = plots.curves({'tasks': rows})
  labels = {text.get_text() for legend in figure.legends for text in legend.get_texts()}
  assert {'tasks (validation xx-cp)', 'tasks (validation xx-up)'} <= labels


@pytest.mark.slow
def test_the_target_language_steers_translation_and_scoring(tasks_run, text_dir, tmp_path):
  sources = synthetic.pairs('test')[0][:40]
  path = tmp_path / 'sources.txt'
  path.write_text(''.join(source + '\n' for source in sources), encoding='utf-8')
  outputs = {}
  for task in TASKS:
    result = run_script('translate.py', f'--workdir={tasks_run}', f'--input={path}',
                        f'--target_lang={task}')
    assert result.returncode == 0, result.stderr[-3000:]
    outputs[task] = result.stdout.splitlines()
  chrf = lambda hypotheses, task: sacrebleu.corpus_chrf(
      hypotheses, [[TASKS[task](source) for source in sources]]).score
  # Each tag asks for its own task: its outputs are far nearer that task's references.
  assert chrf(outputs['cp'], 'cp') > chrf(outputs['cp'], 'up') + 20
  assert chrf(outputs['up'], 'up') > chrf(outputs['up'], 'cp') + 20
  (tmp_path / 'copies.txt').write_text(''.join(s + '\n' for s in sources), encoding='utf-8')
  scores = {}
  for task in TASKS:
    result = run_script('score.py', f'--workdir={tasks_run}', f'--source_file={path}',
                        f'--target_file={tmp_path / "copies.txt"}', f'--target_lang={task}')
    assert result.returncode == 0, result.stderr[-3000:]
    scores[task] = np.array([float(line.split('\t')[1]) for line in result.stdout.splitlines()[1:]])
  assert (scores['cp'] > scores['up']).mean() > 0.9  # copies are likelier asked for copies
  result = run_script('eval.py', f'--workdir={tasks_run}', '--split=test', '--target_lang=up',
                      f'--output_dir={tmp_path / "eval"}')
  assert result.returncode == 0, result.stderr[-3000:]
  scores = json.loads((tmp_path / 'eval' / 'scores.json').read_text())
  assert scores['evaluated'] == 'text test xx-up'
  hypotheses = (tmp_path / 'eval' / 'hypotheses.txt').read_text(encoding='utf-8').splitlines()
  assert hypotheses[:40] == outputs['up']  # the split's sources tagged as translate.py tags them
  assert scores['sacrebleu'] == pytest.approx(sacrebleu.corpus_bleu(
      hypotheses, [[TASKS['up'](s) for s in synthetic.pairs('test')[0]]]).score)


@pytest.mark.slow
def test_a_missing_or_unknown_target_language_gets_one_line(tasks_run, tiny_run, tmp_path):
  path = tmp_path / 'sources.txt'
  path.write_text('abc de\n', encoding='utf-8')
  translate = lambda workdir, *args: error_line(run_script(
      'translate.py', f'--workdir={workdir}', f'--input={path}', *args))
  assert translate(tasks_run) == (
      "translate.py: the run translates into cp, up (config.pairs='xx-cp,xx-up'): give "
      '--target_lang=LANG, one of those')
  assert translate(tasks_run, '--target_lang=fr') == (
      "translate.py: --target_lang=fr: the run was not trained to translate into it "
      "(config.pairs='xx-cp,xx-up'); give one of cp, up")
  assert translate(tiny_run, '--target_lang=fr') == (
      'translate.py: --target_lang=fr: the run translates en into de only: give '
      '--target_lang=de or none')
  assert error_line(run_script('export.py', f'--workdir={tasks_run}',
                               f'--output_dir={tmp_path / "exported"}')) == (
      f"export.py: {tasks_run} translates several pairs (config.pairs='xx-cp,xx-up'), with "
      "source tags that Marian's tokenizer splits otherwise: only runs of one pair are exported")
