"""translate.py's n-best lists, sampling and ensembles, and score.py, on a trained configs/tiny.py
run, as a user runs them."""

import csv
import json
import shutil

import pytest

from configs import tiny
from conftest import error_line, run_script
from transformer import config as config_lib
from transformer import stored_config
from transformer import data

pytestmark = pytest.mark.slow  # each test trains, compiles or runs a command


@pytest.fixture
def workdir(tiny_run):
  """conftest's tiny run: configs/tiny.py, 100 steps, checkpoints 50, 75 and 100."""
  return tiny_run


@pytest.fixture
def sources(workdir, tmp_path) -> tuple[str, list[str]]:
  """(a file of 12 test sentences with a blank line as line 4, its lines)."""
  lines = data.split_texts(stored_config.load_workdir_config(workdir), 'test')[0][:12]
  lines.insert(3, '')
  path = tmp_path / 'sources.txt'
  path.write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  return str(path), lines


def output_of(*args, devices: int = 2) -> str:
  """stdout of `python ARGS`, which must succeed, on `devices` simulated devices."""
  result = run_script(*args, env={
      'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}'})
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def table(text: str) -> list[dict]:
  """The rows of a translate.py or score.py table, numbers as numbers."""
  rows = list(csv.DictReader(text.splitlines(), delimiter='\t', quoting=csv.QUOTE_NONE))
  for row in rows:
    for key in row:
      if key != 'translation':
        row[key] = (int if key in ('line', 'hypothesis', 'tokens') else float)(row[key])
  return rows


def test_nbest_lists_the_best_hypotheses_of_each_line_the_first_being_its_translation(
    workdir, sources):
  path, lines = sources
  plain = output_of('translate.py', f'--workdir={workdir}', f'--input={path}', '--beam_size=3')
  rows = table(output_of('translate.py', f'--workdir={workdir}', f'--input={path}',
                         '--beam_size=3', '--nbest=3'))
  assert list(rows[0]) == ['line', 'hypothesis', 'log_prob', 'score', 'tokens', 'translation']
  for number, translation in enumerate(plain.splitlines(), 1):
    of_line = [row for row in rows if row['line'] == number]
    if not lines[number - 1]:  # a blank line has no rows
      assert translation == '' and not of_line
      continue
    assert [row['hypothesis'] for row in of_line] == [1, 2, 3]
    assert of_line[0]['translation'] == translation
    assert len({row['translation'] for row in of_line}) == 3
    scores = [row['score'] for row in of_line]
    assert scores == sorted(scores, reverse=True)
    # The GNMT penalty of the run's alpha, 0.6, is at least 1: the score is above the log-prob.
    assert all(row['score'] >= row['log_prob'] for row in of_line)
  assert len(rows) == 3 * 12


def test_score_py_gives_beam_searchs_outputs_the_log_probability_it_found_them_with(
    workdir, sources, tmp_path):
  path, lines = sources
  rows = table(output_of('translate.py', f'--workdir={workdir}', f'--input={path}', '--nbest=2'))
  (tmp_path / 'src.txt').write_text(''.join(lines[row['line'] - 1] + '\n' for row in rows))
  (tmp_path / 'tgt.txt').write_text(''.join(row['translation'] + '\n' for row in rows))
  scores = table(output_of('score.py', f'--workdir={workdir}',
                           f'--source_file={tmp_path / "src.txt"}',
                           f'--target_file={tmp_path / "tgt.txt"}'))
  assert [score['line'] for score in scores] == list(range(1, len(rows) + 1))
  # score.py scores the text as the vocabulary splits it, which the search may have spelled in
  # other pieces (rarely as many): compare those of as many pieces.
  same = [(row, score) for row, score in zip(rows, scores) if row['tokens'] == score['tokens']]
  assert len(same) >= 2 * len(rows) // 3
  for row, score in same:
    assert score['log_prob'] == pytest.approx(row['log_prob'], abs=2e-4)
  for score in scores:
    assert score['log_prob_per_token'] == pytest.approx(score['log_prob'] / score['tokens'],
                                                        abs=1e-4)
  # An ensemble of the run with itself scores as the run; --output writes the same table.
  ensemble = tmp_path / 'scores.tsv'
  output_of('score.py', f'--workdir={workdir}', f'--workdir={workdir}',
            f'--source_file={tmp_path / "src.txt"}', f'--target_file={tmp_path / "tgt.txt"}',
            f'--output={ensemble}')
  assert table(ensemble.read_text()) == scores


def test_samples_depend_on_the_seed_and_line_alone_not_on_the_number_of_devices(workdir, sources):
  path, lines = sources
  sample = lambda *args, devices=2: table(output_of(
      'translate.py', f'--workdir={workdir}', f'--input={path}', '--num_samples=3', *args,
      devices=devices))
  on_two = sample('--sampling=topk', '--seed=5')
  assert sample('--sampling=topk', '--seed=5', devices=1) == on_two
  assert len(on_two) == 3 * 12 and {row['hypothesis'] for row in on_two} == {1, 2, 3}
  other_seed = sample('--sampling=topk', '--seed=6')
  assert [row['translation'] for row in other_seed] != [row['translation'] for row in on_two]
  # Unrestricted draws differ; a cold nucleus of one token each time draws the greedy output.
  assert len({(row['line'], row['translation']) for row in on_two}) > 12
  cold = sample('--sampling=topp', '--top_p=0.01', '--temperature=0.5')
  greedy = output_of('translate.py', f'--workdir={workdir}', f'--input={path}',
                     '--sampling=greedy').splitlines()
  assert all(row['translation'] == greedy[row['line'] - 1] for row in cold)


def test_greedy_sampling_is_a_beam_of_one_as_are_top_k_1_and_temperature_0(workdir, sources):
  path, lines = sources
  outputs = [output_of('translate.py', f'--workdir={workdir}', f'--input={path}', *args)
             for args in (['--beam_size=1'], ['--sampling=greedy'],
                          ['--sampling=topk', '--top_k=1', '--seed=3'],
                          ['--sampling=topp', '--temperature=0'])]
  assert len(outputs[0].splitlines()) == len(lines) and any(outputs[0].splitlines())
  assert outputs[1:] == outputs[:1] * 3


def test_an_ensemble_of_a_run_with_itself_translates_as_the_run(workdir, sources):
  path, _ = sources
  alone = output_of('translate.py', f'--workdir={workdir}', f'--input={path}', '--nbest=2')
  assert output_of('translate.py', f'--workdir={workdir}', f'--workdir={workdir}',
                   f'--input={path}', '--nbest=2') == alone


def test_an_ensemble_of_two_checkpoints_differs_from_each(workdir, sources, tmp_path):
  # The run at step 50 and at step 100, each alone (--average_last=1) and together.
  path, _ = sources
  early = tmp_path / 'early'
  output_of('average_checkpoints.py', f'--workdir={workdir}', '--average_last=1',
            '--up_to_step=50', f'--output_dir={early}')
  translations = {name: output_of('translate.py', *[f'--workdir={w}' for w in workdirs],
                                  f'--input={path}', '--average_last=1')
                  for name, workdirs in (('late', [workdir]), ('early', [early]),
                                         ('both', [workdir, early]))}
  assert translations['both'] not in (translations['late'], translations['early'])


def test_runs_that_cannot_make_an_ensemble_and_bad_decoding_requests_get_one_line(
    workdir, sources, tmp_path):
  path, _ = sources
  other_pair = tmp_path / 'other_pair'
  shutil.copytree(workdir, other_pair)
  config = json.loads((other_pair / 'config.json').read_text())
  config['target_lang'] = 'fr'
  (other_pair / 'config.json').write_text(json.dumps(config))
  other_vocab = tmp_path / 'other_vocab'
  shutil.copytree(workdir, other_vocab)
  fewer = tiny.get_config()  # a vocabulary learned from 50 pairs: other pieces, as many
  fewer.vocab_sample_size = 50
  data.load_or_train_vocabulary(config_lib.validate(fewer), str(tmp_path / 'fewer'))
  shutil.copy(tmp_path / 'fewer' / 'vocab' / 'sentencepiece.model', other_vocab / 'vocab')
  (tmp_path / 'one_line.txt').write_text('a b\n')
  translate = lambda *args: error_line(run_script('translate.py', f'--workdir={workdir}',
                                                  f'--input={path}', *args))
  assert translate(f'--workdir={other_pair}') == (
      f'translate.py: {workdir} translates en-de but {other_pair} en-fr: an ensemble needs runs '
      'of the same language pairs')
  assert translate(f'--workdir={other_vocab}') == (
      f'translate.py: {workdir} and {other_vocab} have different vocabularies: an ensemble '
      'averages the probabilities of the same tokens, so its runs must share one: train the '
      f'others with {workdir}/vocab copied into their workdir before train.py starts (the seed '
      'draws the sample a vocabulary learns from, so runs of other seeds train others)')
  assert translate('--beam_size=2', '--nbest=3') == (
      'translate.py: --nbest=3 asks for more hypotheses than a beam of 2 keeps: give '
      '--beam_size=3 or more')
  assert translate('--sampling=topk', '--top_k=400') == (
      'translate.py: --top_k=400 is more than the 320 tokens of the vocabulary: give fewer, or 0 '
      'for all')
  assert translate('--top_p=0.9') == 'translate.py: --top_p is for --sampling=topp, not beam search'
  assert translate('--sampling=greedy', '--num_samples=2') == (
      'translate.py: --num_samples is for --sampling=topk or --sampling=topp, not '
      '--sampling=greedy')
  assert translate('--sampling=topk', '--nbest=2') == (
      'translate.py: --nbest is for beam search, not --sampling=topk')
  assert error_line(run_script('score.py', f'--workdir={workdir}', f'--source_file={path}',
                               f'--target_file={tmp_path / "one_line.txt"}')) == (
      f'score.py: {path} has 13 lines but {tmp_path / "one_line.txt"} has 1: they must be '
      'aligned line by line')
