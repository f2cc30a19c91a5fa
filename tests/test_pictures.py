"""Training curves and attention heatmaps (transformer/plots.py, plot_curves.py,
plot_attention.py) of the tiny trained run: files written, not blank, labelled, and drawing the
numbers they claim."""

import json
import os

import numpy as np
import pytest
from matplotlib import image as mpimg

from conftest import error_line, run_script
from transformer import data, plots
from transformer import stored_config

pytestmark = pytest.mark.slow  # each test trains, compiles or runs a command


def assert_picture(path):
  """A PNG of some size whose pixels are not all one colour."""
  pixels = mpimg.imread(path)
  assert pixels.shape[0] > 200 and pixels.shape[1] > 200
  assert pixels[..., :3].std() > 0.05


def lines_of(ax) -> dict:
  return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
          for line in ax.get_lines()}


def test_curves_draw_each_metric_against_step_and_hours(tiny_run, tmp_path):
  output = tmp_path / 'curves.png'
  result = run_script('plot_curves.py', f'--workdir={tiny_run}', f'--output={output}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'wrote {output}' in result.stdout
  assert_picture(output)
  # The format the name says; one matplotlib cannot write is refused before drawing.
  for name, start in (('curves.pdf', b'%PDF'), ('curves.svg', b'<?xml')):
    result = run_script('plot_curves.py', f'--workdir={tiny_run}', f'--output={tmp_path / name}')
    assert result.returncode == 0 and (tmp_path / name).read_bytes().startswith(start), name
  assert error_line(run_script('plot_curves.py', f'--workdir={tiny_run}',
                               f'--output={tmp_path / "curves.xyz"}')).startswith(
      f'plot_curves.py: {tmp_path / "curves.xyz"}: matplotlib writes no .xyz picture; end the '
      'name in one of ')
  assert not (tmp_path / 'curves.xyz').exists()

  rows = plots.read_metrics(tiny_run)
  figure = plots.curves({'tiny': rows})
  panels = [ax for ax in figure.axes if ax.get_title()]
  assert [ax.get_title() for ax in panels[:4]] == [
      'loss (label-smoothed)', 'perplexity', 'learning rate (train)', 'sacreBLEU']
  assert [ax.get_xlabel() for ax in panels] == ['step'] * 4 + ['hours'] * 4
  assert [ax.get_yscale() for ax in panels[:4]] == ['linear', 'log', 'linear', 'linear']
  train = [r for r in rows if 'split' not in r]
  validation = [r for r in rows if r.get('split') == 'validation' and 'loss' in r]
  loss_by_step, loss_by_hours = lines_of(panels[0]), lines_of(panels[4])
  assert loss_by_step['tiny (train)'] == ([20, 40, 60, 80, 100], [r['loss'] for r in train])
  assert loss_by_step['tiny (validation)'] == ([50, 100], [r['loss'] for r in validation])
  hours = [(r['time'] - rows[0]['time']) / 3600 for r in train]
  assert loss_by_hours['tiny (train)'] == (hours, [r['loss'] for r in train])
  assert 0 < hours[-1] < 1 and hours == sorted(hours)
  assert lines_of(panels[2])['tiny (train)'][1] == [r['learning_rate'] for r in train]
  # configs/tiny.py scores BLEU only at the end, with the checkpoint average.
  bleu = {r['split']: r['sacrebleu'] for r in rows if 'sacrebleu' in r}
  assert lines_of(panels[3]) == {'tiny (validation, averaged)': ([100], [bleu['validation']]),
                                 'tiny (test, averaged)': ([100], [bleu['test']])}
  (legend,) = figure.legends
  assert [t.get_text() for t in legend.get_texts()] == [
      'tiny (train)', 'tiny (validation)', 'tiny (validation, averaged)', 'tiny (test, averaged)']


def test_curves_compare_runs_and_take_a_resumed_runs_last_rows(tmp_path):
  first = [{'step': s, 'time': 100.0 + s, 'loss': 10.0 - s / 10, 'learning_rate': 1e-3}
           for s in (10, 20, 30)]
  resumed = [{'step': s, 'time': 500.0 + s, 'loss': 5.0 - s / 10, 'learning_rate': 1e-3}
             for s in (20, 30, 40)]
  assert plots.series(first + resumed, 'train', 'loss') == [
      (10, 9.0, 0.0), (20, 3.0, 410.0), (30, 2.0, 420.0), (40, 1.0, 430.0)]
  figure = plots.curves({'a': first, 'b': resumed})
  (legend,) = figure.legends
  assert [t.get_text() for t in legend.get_texts()] == ['a (train)', 'b (train)']
  assert plots.run_names(['x/run', 'y/run/', 'z/other']) == ['x/run', 'y/run', 'other']

  # Two workdirs on one figure from the command; runs logged before 'time' are drawn by step.
  for name, rows in (('a', first), ('b', resumed)):
    os.makedirs(tmp_path / name)
    with open(tmp_path / name / 'metrics.jsonl', 'w') as f:
      f.writelines(json.dumps({k: v for k, v in r.items() if name == 'a' or k != 'time'}) + '\n'
                   for r in rows)
  result = run_script('plot_curves.py', f'--workdir={tmp_path / "a"}',
                      f'--workdir={tmp_path / "b"}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'plot_curves.py: b logged no wall-clock times' in result.stderr
  assert_picture(tmp_path / 'a' / 'curves.png')


def test_curves_read_a_line_being_written_and_name_a_bad_one(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 10, "loss": 2.0}\n{"step": 20, "lo', encoding='utf-8')
  assert plots.read_metrics(str(tmp_path)) == [{'step': 10, 'loss': 2.0}]
  path.write_text('{"step": 10, "loss": 2.0}\n{"step": 20, "lo\n{"step": 30}\n', encoding='utf-8')
  result = run_script('plot_curves.py', f'--workdir={tmp_path}')
  assert error_line(result).startswith(f'plot_curves.py: {path}:2 is not JSON (')
  path.write_text('[1, 2]\n', encoding='utf-8')
  assert error_line(run_script('plot_curves.py', f'--workdir={tmp_path}')).startswith(
      f'plot_curves.py: {path}:1 is not a metrics row')
  missing = tmp_path / 'nowhere'
  assert error_line(run_script('plot_curves.py', f'--workdir={missing}')) == (
      f'plot_curves.py: {missing}/metrics.jsonl not found: --workdir takes a train.py workdir')


@pytest.mark.parametrize('content, problem', [
    (b'', 'holds no row yet: plot once the run has logged its first log_every_steps'),
    (b'{"step": 10, "loss": 2.0}\n{"step": 20, "loss": "2.1"}\n',
     ':2 is not a metrics row: its "loss" is \'2.1\', not a number; delete or mend that line'),
    (b'{"step": 10, "time": "noon", "loss": 2.0}\n',
     ':1 is not a metrics row: its "time" is \'noon\', not a number; delete or mend that line'),
    (b'{"step": 10, "loss": 2.0}\n{"step": 20, "note": "\xff"}\n',
     ':2 is not a metrics row (not UTF-8, byte 22): delete or mend that line'),
])
def test_curves_refuse_rows_they_cannot_draw_and_draw_nothing(tmp_path, content, problem):
  path = tmp_path / 'metrics.jsonl'
  path.write_bytes(content)
  result = run_script('plot_curves.py', f'--workdir={tmp_path}')
  assert error_line(result) == f'plot_curves.py: {path}{" " if not content else ""}{problem}'
  assert os.listdir(tmp_path) == ['metrics.jsonl']


@pytest.mark.slow
def test_attention_heatmaps_are_labelled_with_the_pieces(tiny_run, tmp_path):
  sentence = data.split_texts(stored_config.load_workdir_config(tiny_run), 'test')[0][0]
  result = run_script('plot_attention.py', f'--workdir={tiny_run}',
                      f'--sentence={sentence}', f'--output_dir={tmp_path}')
  assert result.returncode == 0, result.stderr[-3000:]
  for name in plots.KINDS:
    assert f'wrote {tmp_path / name}.png' in result.stdout
    assert_picture(tmp_path / f'{name}.png')

  translation, figures = plots.attention_figures(tiny_run, sentence)
  assert f'translation: {translation}' in result.stdout
  vocab = data.load_vocabulary(stored_config.load_workdir_config(tiny_run), tiny_run)
  source = vocab.pieces(vocab.encode(sentence) + [data.EOS_ID])
  target = vocab.pieces(vocab.encode(translation) + [data.EOS_ID])
  assert source[-1] == target[-1] == '</s>' and len(target) > 1
  expected = {  # (x tick labels, y tick labels) of every panel
      'encoder_self_attention': (source, source),
      'decoder_self_attention': (['<start>'] + target[:-1], target),
      'cross_attention': (source, target)}
  for name, figure in figures.items():
    panels = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [
        f'layer {layer}, head {head}' for layer in (1, 2) for head in (1, 2, 3, 4)]
    for ax in panels:
      assert ([t.get_text() for t in ax.get_xticklabels()],
              [t.get_text() for t in ax.get_yticklabels()]) == expected[name]
      weights = ax.get_images()[0].get_array()
      assert weights.shape == (len(expected[name][1]), len(expected[name][0]))
      np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    assert figure.get_suptitle().endswith(f'"{sentence}" -> "{translation}"')
  # Decoder self-attention never looks ahead.
  weights = figures['decoder_self_attention'].axes[0].get_images()[0].get_array()
  assert np.all(np.triu(weights, 1) == 0)


def test_attention_of_a_sentence_longer_than_max_length_is_of_what_was_translated(tiny_run):
  sentence = data.split_texts(stored_config.load_workdir_config(tiny_run), 'test')[0][0]
  # Both cut to their first 16 tokens (config.max_length), which they share.
  longer, long = (plots.attention_figures(tiny_run, ' '.join([sentence] * times))
                  for times in (300, 20))
  assert longer[0] == long[0]  # the translation
  for name, figure in longer[1].items():
    assert figure.get_suptitle() == long[1][name].get_suptitle()
  source = [t.get_text() for t in longer[1]['encoder_self_attention'].axes[0].get_xticklabels()]
  assert len(source) == 16 and source[-1] == '</s>'


def test_attention_errors_are_one_line(tiny_run, tmp_path):
  assert error_line(run_script('plot_attention.py', f'--workdir={tiny_run}',
                               '--sentence= ')) == (
      'plot_attention.py: --sentence is empty; give the sentence to translate')
  missing = tmp_path / 'nowhere'
  assert error_line(run_script('plot_attention.py', f'--workdir={missing}',
                               '--sentence=abc')) == (
      f'plot_attention.py: {missing}/config.json not found: --workdir must be a directory train.py wrote')
