"""eval.py, checkpoint averaging and the translate command on a trained configs/tiny.py run."""

import codecs
import gzip
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sacrebleu

from conftest import error_line, popen_as_from_a_terminal, run_script
from transformer import bleu, checkpoints, data, translate
from transformer import stored_config


def orbax_info_lines(log: str) -> list[str]:
  """absl's INFO lines written from a file of orbax's (named as absl does: its base name)."""
  orbax_dir = os.path.dirname(ocp.__file__)
  orbax_files = {name for _, _, names in os.walk(orbax_dir) for name in names}
  ours = {name for _, _, names in os.walk(os.path.dirname(checkpoints.__file__)) for name in names}
  return [line for line in log.splitlines()
          if re.match(r'I\d{4} ', line) and line.split()[3].split(':')[0] in orbax_files - ours]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def workdir(tiny_run):
  """conftest's tiny run: configs/tiny.py, 100 steps, checkpoints 50, 75 and 100."""
  return tiny_run


@pytest.mark.slow
def test_training_ends_with_bleu_of_the_averaged_checkpoints(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  final = [r for r in rows if 'checkpoint_steps' in r]
  # configs/tiny.py averages the last 2 checkpoints, as eval.py does by default.
  assert [(r['split'], r['step'], r['checkpoint_steps']) for r in final] == [
      ('validation', 100, [75, 100]), ('test', 100, [75, 100])]
  assert [r for r in rows if r.get('split') == 'test'] == final[1:]
  assert all(0 <= r['sacrebleu'] <= 100 and 0 <= r['bleu_paper'] <= 100 for r in final)


@pytest.mark.slow
def test_eval_writes_hypotheses_and_scores(workdir, tmp_path):
  result = run_script('eval.py', f'--workdir={workdir}', f'--output_dir={tmp_path}')
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / 'scores.json') as f:
    scores = json.load(f)
  with open(tmp_path / 'hypotheses.txt', encoding='utf-8') as f:
    hypotheses = f.read().splitlines()
  config = stored_config.load_workdir_config(workdir)
  sources, references = data.split_texts(config, 'test')
  assert len(hypotheses) == len(sources) == scores['num_sentences'] == 200
  assert scores['checkpoint_steps'] == [75, 100]  # config.average_last=2 by default
  assert (scores['beam_size'], scores['alpha']) == (config.beam_size, config.alpha)
  assert scores['compile_secs'] > 0 and scores['sentences_per_sec'] > 0
  assert scores['sacrebleu'] == pytest.approx(
      sacrebleu.corpus_bleu(hypotheses, [references]).score, abs=1e-9)
  assert scores['sacrebleu_signature'] == bleu.sacrebleu_score(hypotheses, references, 'de')[1]
  assert scores['bleu_paper'] == pytest.approx(
      bleu.paper_bleu(hypotheses, references, 'de', compound_split=True))
  assert scores['bleu_paper_variant'] == bleu.paper_variant(compound_split=True)
  assert scores['bleu_lowercased'] == pytest.approx(
      bleu.lowercase_bleu(hypotheses, references, 'de'))
  assert scores['bleu_lowercased_variant'] == bleu.lowercase_variant('de')
  assert (scores['chrf'], scores['chrf_signature']) == (
      pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score, abs=1e-9),
      bleu.chrf_score(hypotheses, references)[1])
  assert 'sacreBLEU' in result.stdout and '200 sentences' in result.stdout
  # Progress in a log (stderr is no terminal here): a line at each tenth of the sentences done,
  # here after each of the two beam-search calls.
  done = [int(n) for n in re.findall(
      r'translated (\d+)/200 sentences \| [\d.]+ sentences/s \| eta \dh\d\dm\d\ds', result.stderr)]
  assert done == [128, 200], result.stderr[-3000:]
  assert orbax_info_lines(result.stderr) == [], result.stderr[-3000:]
  # The training run's own test BLEU came from the same averaged parameters and settings.
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    final = [json.loads(line) for line in f if '"test"' in line][0]
  assert final['sacrebleu'] == pytest.approx(scores['sacrebleu'], abs=1e-6)


def test_averaging_is_the_elementwise_mean(workdir):
  config = stored_config.load_workdir_config(workdir)
  averaged, steps = checkpoints.load_params(workdir, config, average_last=3)
  assert steps == [50, 75, 100]
  store, like = checkpoints.Checkpoints(workdir), checkpoints.state_shapes(config)
  each = [store.restore(step, like)[0]['params'] for step in steps]
  store.close()
  for leaf, *leaves in zip(jax.tree_util.tree_leaves(averaged),
                           *[jax.tree_util.tree_leaves(p) for p in each]):
    np.testing.assert_allclose(leaf, np.mean(leaves, axis=0), rtol=1e-6, atol=1e-7)
  assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(each[0]),
                                                          jax.tree_util.tree_leaves(each[2]))) > 0


def test_default_average_is_the_configs_or_all_kept_checkpoints(workdir, tmp_path):
  config = stored_config.load_workdir_config(workdir)
  assert config.average_last == 2
  assert checkpoints.load_params(workdir, config)[1] == [75, 100]
  assert translate.load(workdir, None, None, None)[3] == [75, 100]
  assert translate.load(workdir, 1, None, None)[3] == [100]
  # A run that kept fewer checkpoints than config.average_last averages those it has.
  fewer = tmp_path / 'fewer'
  shutil.copytree(workdir, fewer)
  for step in ('50', '75'):
    shutil.rmtree(fewer / 'checkpoints' / step)
  assert checkpoints.load_params(str(fewer), config)[1] == [100]


@pytest.mark.slow
def test_up_to_step_averages_the_checkpoints_the_run_held_at_that_step(workdir, tmp_path):
  config = stored_config.load_workdir_config(workdir)
  assert checkpoints.load_params(workdir, config, up_to_step=100)[1] == [75, 100]
  # The run as it stood at step 75 or 99: the same mean as a copy that never got further.
  earlier = tmp_path / 'earlier'
  shutil.copytree(workdir, earlier)
  shutil.rmtree(earlier / 'checkpoints' / '100')
  expected, expected_steps = checkpoints.load_params(str(earlier), config)
  for step in (75, 99):
    then, steps = checkpoints.load_params(workdir, config, up_to_step=step)
    assert steps == expected_steps == [50, 75]
    for a, b in zip(jax.tree_util.tree_leaves(then), jax.tree_util.tree_leaves(expected)):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(checkpoints.CheckpointError) as error:
    checkpoints.load_params(workdir, config, average_last=3, up_to_step=75)
  assert str(error.value) == (f'average_last=3, but {workdir}/checkpoints holds 2 scheduled '
                              'checkpoints at or before step 75 (steps [50, 75]); ask for 1 to 2')

  result = run_script('eval.py', f'--workdir={workdir}', '--up_to_step=80', '--average_last=1',
                      f'--output_dir={tmp_path / "eval"}')
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / 'eval' / 'scores.json') as f:
    assert json.load(f)['checkpoint_steps'] == [75]
  assert error_line(run_script('eval.py', f'--workdir={workdir}', '--up_to_step=49',
                               f'--output_dir={tmp_path / "none"}')) == (
      f'eval.py: {workdir}/checkpoints holds no checkpoint at or before step 49 (steps '
      '[50, 75, 100]); ask for a later step')
  assert not (tmp_path / 'none').exists()
  # A long run's kept steps are named by their ends.
  assert checkpoints._named(list(range(100, 6600, 100))) == (  # pylint: disable=protected-access
      '65 steps: 100, 200, ..., 6400, 6500')


@pytest.mark.slow
def test_average_checkpoints_writes_a_workdir_eval_can_read(workdir, tmp_path):
  out = str(tmp_path / 'averaged')
  result = run_script('average_checkpoints.py', f'--workdir={workdir}', '--average_last=2',
                      f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  config = stored_config.load_workdir_config(out)
  assert config.average_last == 1  # its one checkpoint is the average already
  written, steps = checkpoints.load_params(out, config)
  expected, _ = checkpoints.load_params(workdir, config, average_last=2)
  assert steps == [100]
  for a, b in zip(jax.tree_util.tree_leaves(written), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_array_equal(a, b)
  assert data.load_vocabulary(config, out).vocab_size == config.vocab_size
  # --up_to_step: the run as it stood at step 80, its checkpoint at 75 the newest averaged.
  then = str(tmp_path / 'then')
  result = run_script('average_checkpoints.py', f'--workdir={workdir}', '--average_last=2',
                      '--up_to_step=80', f'--output_dir={then}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'averaged steps [50, 75]' in result.stdout
  written, steps = checkpoints.load_params(then, config)
  expected, _ = checkpoints.load_params(workdir, config, average_last=2, up_to_step=80)
  assert steps == [75]
  for a, b in zip(jax.tree_util.tree_leaves(written), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_array_equal(a, b)
  # A workdir, the run's own included, is refused before any checkpoint is read, and so is a
  # directory that holds checkpoints.
  before = {path: path.read_bytes() for path in pathlib.Path(workdir).rglob('*') if path.is_file()}
  for existing in (out, workdir):
    assert error_line(run_script('average_checkpoints.py', f'--workdir={workdir}',
                                 f'--output_dir={existing}')) == (
        f"average_checkpoints.py: --output_dir: {existing} holds a config.json already (a run's "
        'workdir?); choose a new directory')
  os.remove(os.path.join(out, 'config.json'))
  assert error_line(run_script('average_checkpoints.py', f'--workdir={workdir}',
                               f'--output_dir={out}')) == (
      f'average_checkpoints.py: {out}/checkpoints already holds checkpoints; choose a new '
      'directory')
  assert {path: path.read_bytes() for path in pathlib.Path(workdir).rglob('*')
          if path.is_file()} == before


@pytest.mark.slow
def test_an_average_cut_short_leaves_nothing_that_blocks_its_rerun(workdir, tmp_path):
  """A new OUT appears whole or not at all: a process killed (SIGKILL) while writing one leaves
  no OUT, and average_checkpoints.py then writes it as if it had never run."""
  out = tmp_path / 'averaged'
  killed = subprocess.run([sys.executable, '-c', (
      'import os, signal\n'
      'from transformer import files\n'
      'def write(directory):\n'
      '  os.makedirs(os.path.join(directory, "checkpoints", "100"))\n'
      '  os.kill(os.getpid(), signal.SIGKILL)\n'
      f'files.write_directory({str(out)!r}, write)\n')], cwd=ROOT, check=False)
  assert killed.returncode == -signal.SIGKILL and not out.exists()
  result = run_script('average_checkpoints.py', f'--workdir={workdir}', '--average_last=2',
                      f'--output_dir={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert stored_config.load_workdir_config(str(out)).average_last == 1
  assert sorted(os.listdir(out)) == ['checkpoints', 'config.json', 'vocab']



@pytest.mark.slow
def test_an_average_that_a_full_disk_stops_says_so_in_one_line_and_leaves_nothing(workdir,
                                                                                  tmp_path):
  out = tmp_path / 'averaged'
  result = run_script('average_checkpoints.py', f'--workdir={workdir}', '--average_last=2',
                      f'--output_dir={out}', max_file_bytes=100_000)  # a checkpoint: ~600 kB
  assert re.fullmatch(
      rf'average_checkpoints.py: checkpoint \d+ could not be written to {tmp_path}/\.averaged\.'
      r'tmp-\w+/checkpoints \(File too large; a checkpoint takes 0\.\d\d MiB, [\d.]+ MiB are '
      r'free there\): the average was not written; free space and run the same command again',
      error_line(result)), result.stderr[-3000:]
  assert 'Traceback' not in result.stderr and os.listdir(tmp_path) == []

@pytest.mark.slow
def test_translate_command_reads_stdin(workdir, tmp_path):
  config = stored_config.load_workdir_config(workdir)
  sources, _ = data.split_texts(config, 'test')
  result = run_script('translate.py', f'--workdir={workdir}',
                      stdin=''.join(s + '\n' for s in sources[:5]))
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert len(lines) == 5 and all(lines)
  # The same sentences as a file give the same translations.
  (tmp_path / 'in.txt').write_text(''.join(s + '\n' for s in sources[:5]), encoding='utf-8')
  result = run_script('translate.py', f'--workdir={workdir}',
                      f'--input={tmp_path / "in.txt"}', f'--output={tmp_path / "out.txt"}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / 'out.txt').read_text(encoding='utf-8').splitlines() == lines


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() == 'gpu',
                    reason='a GPU runs the kernels this test needs a backend to lack')
def test_a_run_trained_with_a_gpus_kernels_translates_on_another_backend(workdir, tmp_path):
  # A config.json naming kernels only a GPU runs: translate.py runs XLA's instead, logging each
  # replacement, and translates as the run's own config does.
  config = stored_config.load_workdir_config(workdir)
  sources, _ = data.split_texts(config, 'test')
  gpu_run = tmp_path / 'gpu_run'
  shutil.copytree(workdir, gpu_run)
  stored = json.loads((gpu_run / 'config.json').read_text())
  # A GPU's attention, and a key since removed.
  stored['implementation']['attention'] = 'cudnn'
  stored['model']['norm_implementation'] = 'pallas'
  (gpu_run / 'config.json').write_text(json.dumps(stored))
  lines = ''.join(s + '\n' for s in sources[:3])
  results = [run_script('translate.py', f'--workdir={path}', stdin=lines)
             for path in (workdir, gpu_run)]
  assert all(result.returncode == 0 for result in results), results[1].stderr[-3000:]
  assert results[1].stdout == results[0].stdout and len(results[0].stdout.splitlines()) == 3
  assert ("config.implementation.attention='cudnn': not on this machine (cpu); '' instead"
          in results[1].stderr), results[1].stderr[-3000:]


@pytest.mark.slow
def test_bad_inputs_give_one_clear_error(workdir, tmp_path):
  missing = str(tmp_path / 'nowhere')
  assert error_line(run_script('eval.py', f'--workdir={missing}', f'--output_dir={tmp_path}')) == (
      f'eval.py: {missing}/config.json not found: --workdir must be a directory train.py wrote')

  untrained = tmp_path / 'untrained'
  shutil.copytree(workdir, untrained, ignore=shutil.ignore_patterns('checkpoints'))
  for script, *args in (('eval.py', f'--output_dir={tmp_path}'), ('translate.py',)):
    result = run_script(script, f'--workdir={untrained}', *args, stdin='a\n')
    assert error_line(result) == (
        f'{script}: {untrained}/checkpoints holds no checkpoint; train first')
    assert not (untrained / 'checkpoints').exists()  # readers make nothing in a workdir

  assert 'average_last=4, but' in error_line(
      run_script('eval.py', f'--workdir={workdir}', '--average_last=4', f'--output_dir={tmp_path}'))

  source, reference = tmp_path / 'src.txt', tmp_path / 'ref.txt'
  source.write_text('a b\nc d\n', encoding='utf-8')
  reference.write_text('x y\n', encoding='utf-8')
  assert error_line(run_script('eval.py', f'--workdir={workdir}', f'--source_file={source}',
                               f'--reference_file={reference}', f'--output_dir={tmp_path}')) == (
      f'eval.py: {source} has 2 lines but {reference} has 1: they must be aligned line by line')
  for text in (source, reference):
    text.write_text('', encoding='utf-8')
  assert error_line(run_script('eval.py', f'--workdir={workdir}', f'--source_file={source}',
                               f'--reference_file={reference}', f'--output_dir={tmp_path}')) == (
      f'eval.py: {source} is empty: give one sentence per line to evaluate')
  assert not (tmp_path / 'scores.json').exists()


IN_THE_WAY = 'a file of that name exists'


@pytest.mark.slow
@pytest.mark.parametrize('command,why', [
    (('eval.py', '--output_dir=FILE'),
     f'--output_dir: FILE cannot be made a directory ({IN_THE_WAY})'),
    (('average_checkpoints.py', '--output_dir=FILE/run'),
     '--output_dir: FILE/run cannot be made a directory (Not a directory)'),
    (('translate.py', '--output=FILE/out.txt'),
     f'--output=FILE/out.txt: FILE cannot be made a directory ({IN_THE_WAY})'),
    (('plot_curves.py', '--output=FILE/curves.png'),
     f'--output=FILE/curves.png: FILE cannot be made a directory ({IN_THE_WAY})'),
    (('plot_attention.py', '--sentence=a', '--output_dir=FILE'),
     f'--output_dir: FILE cannot be made a directory ({IN_THE_WAY})'),
])
def test_an_output_path_under_a_file_stops_the_command_first(workdir, tmp_path, command, why):
  file = str(tmp_path / 'file')
  open(file, 'w', encoding='utf-8').close()
  script, *args = command
  result = run_script(script, f'--workdir={workdir}', *[a.replace('FILE', file) for a in args],
                      stdin='a\n')
  assert error_line(result) == f'{script}: {why.replace("FILE", file)}; give a directory path'
  assert 'translated' not in result.stderr  # before any translating
  assert os.listdir(tmp_path) == ['file']


READ_ONLY = '/sys'  # read-only for root too


@pytest.mark.parametrize('command, line', [
    (('eval.py', '--output_dir=READ_ONLY'),
     '--output_dir: READ_ONLY takes no new file (Permission denied); give a directory you can '
     'write to'),
    (('eval.py', '--output_dir=TMP'), '--output_dir: TMP/scores.json is a directory; give '
     'another path, or move it away'),
    (('translate.py', '--output=TMP/scores.json'), '--output=TMP/scores.json: TMP/scores.json '
     'is a directory; give another path, or move it away'),
    (('translate.py', '--output=READ_ONLY/out.txt'), '--output=READ_ONLY/out.txt: READ_ONLY takes '
     'no new file (Permission denied); give a directory you can write to'),
    (('plot_curves.py', '--output=TMP/scores.json'), '--output=TMP/scores.json: TMP/scores.json '
     'is a directory; give another path, or move it away'),
    (('plot_attention.py', '--sentence=a', '--output_dir=READ_ONLY'), '--output_dir: READ_ONLY '
     'takes no new file (Permission denied); give a directory you can write to'),
    (('average_checkpoints.py', '--output_dir=READ_ONLY'), '--output_dir: READ_ONLY takes no new '
     'file (Permission denied); give a directory you can write to'),
])
@pytest.mark.slow
def test_an_output_that_cannot_be_written_stops_the_command_before_its_work(workdir, tmp_path,
                                                                            command, line):
  (tmp_path / 'scores.json').mkdir()
  script, *args = command
  fill = lambda text: text.replace('READ_ONLY', READ_ONLY).replace('TMP', str(tmp_path))
  result = run_script(script, f'--workdir={workdir}', *map(fill, args), stdin='a\n')
  assert error_line(result) == f'{script}: {fill(line)}'
  assert 'translated' not in result.stderr and 'restored' not in result.stderr
  assert os.listdir(tmp_path) == ['scores.json']


@pytest.mark.slow
def test_a_failed_or_interrupted_evaluation_leaves_no_output_directory(workdir, tmp_path):
  output_dir = tmp_path / 'eval'
  assert 'average_last=4, but' in error_line(run_script(
      'eval.py', f'--workdir={workdir}', '--average_last=4', f'--output_dir={output_dir}'))
  assert os.listdir(tmp_path) == []
  # Ctrl-C or SIGTERM (a preempted job) while translating: one line, the signal's status,
  # nothing written.
  sources, references = data.split_texts(stored_config.load_workdir_config(workdir), 'test')
  for side, lines in (('source', sources), ('reference', references)):
    (tmp_path / side).write_text('\n'.join(lines * 40) + '\n', encoding='utf-8')
  for signum, status, said in ((signal.SIGINT, 130, 'Ctrl-C'), (signal.SIGTERM, 143, 'SIGTERM')):
    process = popen_as_from_a_terminal(
        [sys.executable, 'eval.py', f'--workdir={workdir}', f'--source_file={tmp_path}/source',
         f'--reference_file={tmp_path}/reference', f'--output_dir={output_dir}'],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=1'))
    for line in process.stderr:
      if re.search(r'translated \d+/8000 sentences', line):
        break
    process.send_signal(signum)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == status and 'Traceback' not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f'eval.py: stopped by {said}; the files it was writing are as they were')
    assert sorted(os.listdir(tmp_path)) == ['reference', 'source']


@pytest.mark.parametrize('script', ['train.py', 'eval.py', 'translate.py'])
def test_a_signal_while_a_command_imports_its_libraries_ends_it_in_one_line(workdir, tmp_path,
                                                                           script):
  """Python's own Ctrl-C was a page of import traceback here, or was dropped by JAX's garbage
  collector callback and the command ran on."""
  args = {'train.py': ('--config=configs/tiny.py', f'--workdir={tmp_path}/run'),
          'eval.py': (f'--workdir={workdir}', f'--output_dir={tmp_path}/eval'),
          'translate.py': (f'--workdir={workdir}', f'--output={tmp_path}/out')}[script]
  for signum, status, said in ((signal.SIGINT, 130, 'Ctrl-C'), (signal.SIGHUP, 129, 'SIGHUP')):
    process = popen_as_from_a_terminal(  # each import's time on stderr as it ends
        [sys.executable, script, *args], cwd=ROOT, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ, PYTHONPROFILEIMPORTTIME='1'))
    for line in process.stderr:
      if line.startswith('import time:') and line.split('|')[-1].strip() == 'jax._src.config':
        break
    else:
      pytest.fail(f'{script} never imported jax._src.config')
    process.send_signal(signum)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == status and 'Traceback' not in stderr, stderr[-3000:]
    # The imports go on beside the line until the process ends, their times around it.
    assert f'{script}: stopped by {said}; the files it was writing are as they were' in stderr
    assert not [line for line in stderr.splitlines() if line.startswith(('I', 'W', 'E'))]
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_sigterm_while_translate_py_loads_the_run_ends_it_at_once_with_nothing_written(
    workdir, tmp_path):
  (tmp_path / 'input').write_text('A man is riding a bicycle.\n' * 2000, encoding='utf-8')
  process = subprocess.Popen(
      [sys.executable, 'translate.py', f'--workdir={workdir}', f'--input={tmp_path}/input',
       f'--output={tmp_path}/output'], cwd=ROOT, stderr=subprocess.PIPE, text=True)
  for line in process.stderr:
    if 'checkpoint_manager' in line:  # restoring the checkpoints to average
      break
  process.send_signal(signal.SIGTERM)
  stderr = process.communicate(timeout=60)[1]
  assert process.returncode == 143 and stderr.strip().splitlines()[-1] == (
      'translate.py: stopped by SIGTERM; the files it was writing are as they were'), stderr
  assert os.listdir(tmp_path) == ['input']


@pytest.mark.slow
def test_a_runs_config_that_this_version_refuses_is_named_with_a_fix_in_it(workdir, tmp_path):
  run = tmp_path / 'run'
  shutil.copytree(workdir, run)
  config = json.loads((run / 'config.json').read_text())
  (run / 'config.json').write_text(json.dumps(dict(config, warmup_steps=0)))
  fix = f'set "warmup_steps" to N in {run}/config.json'
  for script, *args in (('eval.py', f'--output_dir={tmp_path}/eval'), ('translate.py',)):
    assert error_line(run_script(script, f'--workdir={run}', *args, stdin='a\n')) == (
        f'{script}: config.warmup_steps=0: must be an integer >= 1; {fix}')
  (run / 'config.json').write_text(json.dumps(dict(config, dataset='text', test_files='',
                                                   train_files='data/{lang}')))
  assert error_line(run_script('eval.py', f'--workdir={run}', f'--output_dir={tmp_path}/eval')) == (
      'eval.py: config.test_files is empty: name the test files of dataset=text ({lang} is '
      f'replaced by a language code); set "test_files" to e.g. data/test.{{lang}}.gz in '
      f'{run}/config.json')
  # A key the fix cannot give a value for: the message names the run's config.json.
  (run / 'config.json').write_text(json.dumps(dict(config, dataset='multi30k',
                                                   manual_dir=f'{tmp_path}/moved')))
  assert error_line(run_script('eval.py', f'--workdir={run}', f'--output_dir={tmp_path}/eval')) == (
      f"eval.py: {run}/config.json: config.manual_dir='{tmp_path}/moved': no such directory; "
      'give the directory holding train/val/test_2016_flickr.{en,de,fr}.gz, or leave it empty to '
      'download them')
  (run / 'config.json').write_text(json.dumps(dict(config, xla_flags='--xla_no_such_flag=1')))
  for script, *args in (('eval.py', f'--output_dir={tmp_path}/eval'), ('translate.py',)):
    assert error_line(run_script(script, f'--workdir={run}', *args, stdin='a\n')).startswith(
        f"{script}: {run}/config.json: config.xla_flags='--xla_no_such_flag=1': XLA rejects it")
  assert not os.path.exists(tmp_path / 'eval')


@pytest.mark.slow
def test_a_line_of_thousands_of_words_is_cut_to_what_the_model_takes_and_named(workdir):
  long = ' '.join(['ab cd ef'] * 2000)
  result = run_script('translate.py', f'--workdir={workdir}', stdin=f'\nab cd\n{long}\n')
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'1 input line\(s\) have more than 16 tokens \(with EOS\), the most '
                   r'config.max_length lets through: line 3 \(\d+ tokens\); each is translated '
                   r'from its first 16 tokens only', result.stderr), result.stderr[-3000:]
  assert len(result.stdout.splitlines()) == 3


@pytest.mark.slow
def test_input_that_is_not_utf8_gets_one_line_naming_it(workdir, tmp_path):
  bad, good = tmp_path / 'bad.txt', tmp_path / 'good.txt'
  bad.write_bytes(b'A man.\n\xff\xfe dog\n')
  good.write_text('Ein Mann.\nEin Hund.\n', encoding='utf-8')
  why = 'invalid UTF-8 (invalid start byte at byte 0); re-encode the text as UTF-8'
  translate_command = ('translate.py', f'--workdir={workdir}')
  assert error_line(run_script(*translate_command, stdin=bad.read_bytes())) == (
      f'translate.py: <stdin>:2: {why}')
  assert error_line(run_script(*translate_command, f'--input={bad}')) == (
      f'translate.py: {bad}:2: {why}')
  assert error_line(run_script(*translate_command, f'--input={tmp_path}')) == (
      f'translate.py: {tmp_path}: a directory, not a file; give a file of one sentence per line')
  for source, reference in ((bad, good), (good, bad)):
    assert error_line(run_script('eval.py', f'--workdir={workdir}', f'--source_file={source}',
                                 f'--reference_file={reference}', f'--output_dir={tmp_path}')) == (
        f'eval.py: {bad}:2: {why}')


@pytest.mark.slow
def test_a_byte_order_mark_changes_nothing_and_a_cut_gzip_file_gets_one_line(workdir, tmp_path):
  sources, references = data.split_texts(stored_config.load_workdir_config(workdir), 'test')
  sources, references = sources[:20], references[:20]
  scores = {}
  for name, bom in (('plain', b''), ('bom', codecs.BOM_UTF8)):
    for side, lines in (('source', sources), ('reference', references)):
      (tmp_path / f'{name}.{side}').write_bytes(bom + '\n'.join(lines).encode('utf-8') + b'\n')
    result = run_script('eval.py', f'--workdir={workdir}',
                        f'--source_file={tmp_path}/{name}.source',
                        f'--reference_file={tmp_path}/{name}.reference',
                        f'--output_dir={tmp_path}/{name}_out')
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / f'{name}_out' / 'scores.json') as f:
      scores[name] = json.load(f)['sacrebleu']
    assert (tmp_path / f'{name}_out' / 'hypotheses.txt').read_text(encoding='utf-8') == (
        (tmp_path / 'plain_out' / 'hypotheses.txt').read_text(encoding='utf-8'))
  assert scores['bom'] == scores['plain']

  whole = gzip.compress('\n'.join(sources).encode('utf-8'))
  cut = tmp_path / 'cut.gz'
  cut.write_bytes(whole[:len(whole) // 2])
  assert error_line(run_script('translate.py', f'--workdir={workdir}', f'--input={cut}')) == (
      f'translate.py: {cut}: not a whole gzip file (Compressed file ended before the '
      'end-of-stream marker was reached); download or copy it again')


@pytest.mark.slow
def test_gzipped_stdin_translates_as_the_text_and_closed_stdin_or_stdout_get_one_line(workdir):
  text = 'a b\nc d e\n'
  plain = run_script('translate.py', f'--workdir={workdir}', stdin=text)
  gzipped = run_script('translate.py', f'--workdir={workdir}', stdin=gzip.compress(text.encode()))
  assert plain.returncode == gzipped.returncode == 0, gzipped.stderr[-3000:]
  assert gzipped.stdout == plain.stdout and len(plain.stdout.splitlines()) == 2
  closed = subprocess.run(['sh', '-c', 'exec "$0" "$@" <&-', sys.executable, 'translate.py',
                           f'--workdir={workdir}'], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
  assert error_line(closed) == (
      'translate.py: stdin is closed: pipe the sentences in, or give --input=FILE')
  closed = subprocess.run(['sh', '-c', 'exec "$0" "$@" >&-', sys.executable, 'translate.py',
                           f'--workdir={workdir}'], cwd=ROOT, input='a\n', capture_output=True,
                          text=True, timeout=600)
  assert error_line(closed) == (
      'translate.py: stdout is closed: give --output=FILE, or leave stdout open')


@pytest.mark.slow
@pytest.mark.parametrize('script,args', [
    ('eval.py', ('--output_dir={tmp}/out',)),
    ('translate.py', ()),
    ('export.py', ('--output_dir={tmp}/out',)),
    ('average_checkpoints.py', ('--output_dir={tmp}/out',)),
    ('plot_attention.py', ('--sentence=a', '--output_dir={tmp}/out')),
    ('plot_curves.py', ('--output={tmp}/out.png',)),
    ('train.py', ('--config=configs/tiny.py',)),
])
def test_a_workdir_that_is_a_symlink_loop_gets_one_line(script, args, tmp_path):
  loop = tmp_path / 'loop'
  os.symlink(loop, loop)
  message = error_line(run_script(script, f'--workdir={loop}',
                                  *(arg.format(tmp=tmp_path) for arg in args), stdin='a\n'))
  name = 'metrics.jsonl' if script == 'plot_curves.py' else 'config.json'
  assert message == {
      'train.py': f'train.py: --workdir: {loop} cannot be made a directory (a symbolic link to '
                  f'{loop}, which leads to no directory); give a directory path',
      'plot_curves.py': f'plot_curves.py: {loop}/{name} cannot be read (Too many levels of '
                        'symbolic links): --workdir takes a train.py workdir, readable by this '
                        'user',
  }.get(script, f'{script}: {loop}/{name} cannot be read (Too many levels of symbolic links): '
                '--workdir must be a directory train.py wrote, readable by this user')
  assert os.listdir(tmp_path) == ['loop']


@pytest.mark.slow
@pytest.mark.parametrize('platform,why', [
    ('tpu', "Unable to initialize backend 'tpu': "),
    ('cuda', 'no installed plugin provides it'),
])
def test_a_platform_jax_cannot_start_here_gets_one_line(workdir, tmp_path, platform, why):
  if jax.default_backend() != 'cpu':
    pytest.skip('needs a machine without the accelerator that JAX_PLATFORMS names')
  env = {'JAX_PLATFORMS': platform}
  for script, *args in (('train.py', '--config=configs/tiny.py', f'--workdir={tmp_path}/run'),
                        ('eval.py', f'--workdir={workdir}', f'--output_dir={tmp_path}/eval'),
                        ('translate.py', f'--workdir={workdir}'),
                        ('average_checkpoints.py', f'--workdir={workdir}',
                         f'--output_dir={tmp_path}/average')):
    message = error_line(run_script(script, *args, stdin='a\n', env=env))
    assert message.startswith(f'{script}: JAX cannot start its backend for JAX_PLATFORMS='
                              f'{platform} ({why}'), message
    assert message.endswith('unset JAX_PLATFORMS to use the devices this machine has, or install '
                            "jax for the device (pip install -e '.[cuda12]' or '.[tpu]')")
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_outputs_through_symbolic_links_replace_their_targets(workdir, tmp_path):
  (tmp_path / 'target.txt').write_text('old\n', encoding='utf-8')
  os.symlink('target.txt', tmp_path / 'translations.txt')
  (tmp_path / 'scores').mkdir()
  os.symlink('scores', tmp_path / 'eval')
  result = run_script('translate.py', f'--workdir={workdir}',
                      f'--output={tmp_path}/translations.txt', stdin='a b\nc\n')
  assert result.returncode == 0, result.stderr[-3000:]
  assert len((tmp_path / 'target.txt').read_text(encoding='utf-8').splitlines()) == 2
  assert os.readlink(tmp_path / 'translations.txt') == 'target.txt'
  result = run_script('eval.py', f'--workdir={workdir}', f'--output_dir={tmp_path}/eval')
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(tmp_path / 'scores')) == ['hypotheses.txt', 'scores.json']
  assert sorted(os.listdir(tmp_path)) == ['eval', 'scores', 'target.txt', 'translations.txt']


@pytest.mark.slow
def test_a_checkpoints_file_where_the_directory_goes_is_named(workdir, tmp_path):
  run = tmp_path / 'run'
  shutil.copytree(workdir, run, ignore=shutil.ignore_patterns('checkpoints'))
  (run / 'checkpoints').write_text('x', encoding='utf-8')
  for script, *args in (('eval.py', f'--output_dir={tmp_path}/eval'), ('translate.py',),
                        ('average_checkpoints.py', f'--output_dir={tmp_path}/average')):
    assert error_line(run_script(script, f'--workdir={run}', *args, stdin='a\n')) == (
        f'{script}: {run}/checkpoints is a file where train.py keeps its checkpoints directory; '
        'give the workdir whose checkpoints/ holds them')
  assert sorted(os.listdir(tmp_path)) == ['run']


@pytest.mark.slow
def test_a_damaged_checkpoint_names_its_directory_and_the_fix(workdir, tmp_path):
  damaged = tmp_path / 'damaged'
  shutil.copytree(workdir, damaged)
  step_dir = damaged / 'checkpoints' / '100'
  os.remove(max((p for p in (step_dir / 'state').rglob('*') if p.is_file()),
                key=lambda p: p.stat().st_size))
  message = error_line(run_script('eval.py', f'--workdir={damaged}', f'--output_dir={tmp_path}'))
  assert message.startswith(f'eval.py: {step_dir} cannot be read, a file in it is damaged or '
                            'missing (')
  assert message.endswith('delete that directory to use checkpoint 75 instead')


@pytest.mark.slow
def test_each_command_applies_the_runs_xla_flags_before_jax_starts(workdir, tmp_path):
  # config.xla_flags reaches XLA only if it is in XLA_FLAGS before the backend starts; a command
  # that starts it first (choosing an implementation, reading a checkpoint) warns instead.
  run = tmp_path / 'run'
  shutil.copytree(workdir, run)
  config = json.loads((run / 'config.json').read_text())
  config['xla_flags'] = '--xla_cpu_enable_fast_math=false'
  (run / 'config.json').write_text(json.dumps(config))
  for command in (('translate.py', f'--workdir={run}'),
                  ('eval.py', f'--workdir={run}', '--split=validation',
                   f'--output_dir={tmp_path}/eval'),
                  ('plot_attention.py', f'--workdir={run}', '--sentence=a',
                   f'--output_dir={tmp_path}/pictures')):
    result = run_script(*command, stdin='a\n')
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'not applied' not in result.stderr, (command[0], result.stderr[-3000:])
