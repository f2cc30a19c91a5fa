r"""What a WMT-sized corpus costs before training's first step: prepare.py, a first start with the
data prepared, one without, and a resume.

  python -m benchmarks.wmt_scale [--pairs=4500000] [--data_dir=/tmp/wmt_scale] [--name=wmt_scale]

Generates once into --data_dir gzipped parallel text: --pairs training pairs and 3,000 each of
validation and test, with WMT14 EN-DE-like lengths (lognormal, median 20 words, 1-150) over a Zipf
lexicon of 100,000 made-up words, the German side the same sentence spelt otherwise. Then, with
configs/wmt14.py:base,en-de on it (dataset='text', the model shrunk to SMALL_MODEL): 1. prepare.py
into an empty directory A; 2. train.py with A, a first start with the data prepared; 3. train.py
with an empty B, preparing everything and compiling into a fresh cache; 4. train.py resuming 3's
run. Each train.py run is stopped by a SIGTERM once its first step is logged. From each log, the
seconds to the vocabulary, the training token ids and batches ready and the first step, and the
peak resident memory; and the stored token ids' size. Writes benchmarks/results/<name>.{json,md}.
"""

import glob
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime

import numpy as np
from absl import app, flags

from benchmarks.measure import machine, machine_name, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEXICON = 100_000
# The model shrunk, so that the figures are the input pipeline's: one base-size step of 25,000
# tokens takes ~100 s and 21 GiB on a 2-core CPU.
SMALL_MODEL = ['--config.model.d_model=64', '--config.model.d_ff=128', '--config.model.num_heads=2',
               '--config.model.num_encoder_layers=1', '--config.model.num_decoder_layers=1']
CHUNK = 100_000  # sentences generated at a time
# Log lines that end a phase, and the phase's name.
MARKS = {'vocabulary': r'vocabulary (trained in|read from)',
         'tokens': r'\(train\): (\d+ pairs tokenized in|token ids read from)',
         'batches': r'batching.py:\d+\] .* \(train\): \d+ batches',
         'first_step': r'trainer.py:\d+\] step \d+/'}


def generate(directory: str, pairs: int, seed: int = 0):
  """Writes {train,validation,test}.{en,de}.gz; returns at once if they are there."""
  rng = np.random.default_rng(seed)
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
  words = {lang: np.array([''.join(rng.choice(letters, rng.integers(2, 12)))
                           for _ in range(LEXICON)]) for lang in ('en', 'de')}
  frequency = 1.0 / np.arange(1, LEXICON + 1) ** 1.1
  frequency /= frequency.sum()
  os.makedirs(directory, exist_ok=True)
  for split, size in (('train', pairs), ('validation', 3000), ('test', 3000)):
    paths = {lang: os.path.join(directory, f'{split}.{lang}.gz') for lang in words}
    if all(os.path.exists(p) for p in paths.values()):
      continue
    files = {lang: gzip.open(path + '.tmp', 'wt', compresslevel=1, encoding='utf-8')
             for lang, path in paths.items()}
    for start in range(0, size, CHUNK):
      count = min(CHUNK, size - start)
      lengths = np.clip(rng.lognormal(np.log(20), 0.6, count).astype(int), 1, 150)
      ids = rng.choice(LEXICON, lengths.sum(), p=frequency)
      ends = np.cumsum(lengths)
      for lang, f in files.items():
        tokens = words[lang][ids]
        f.write(''.join(' '.join(tokens[end - n:end]) + '\n' for n, end in zip(lengths, ends)))
    for lang, f in files.items():
      f.close()
      os.replace(paths[lang] + '.tmp', paths[lang])


def timed_run(script: str, args: list[str]) -> dict:
  """Runs `script`; a train.py run up to its first step, then stopped as a preemption would
  (SIGTERM: it saves a checkpoint and exits). Seconds from its start to each of MARKS it logs, and
  its peak memory (GiB)."""
  began = time.time()
  process = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  seconds, lines = {}, []
  for line in process.stdout:
    lines.append(line)
    stamp = re.match(r'I(\d{4}) (\d\d:\d\d:\d\d\.\d+)', line)
    for name, pattern in MARKS.items():
      if stamp and name not in seconds and re.search(pattern, line):
        when = datetime.strptime(f'{datetime.now().year}{stamp[1]} {stamp[2]}',
                                 '%Y%m%d %H:%M:%S.%f')
        seconds[name] = when.timestamp() - began
        if name == 'first_step':
          process.send_signal(signal.SIGTERM)
  _, status, usage = os.wait4(process.pid, 0)
  if status or (script == 'train.py' and 'first_step' not in seconds):
    raise RuntimeError(f'{script} failed:\n{"".join(lines)[-3000:]}')
  return {**seconds, 'total': time.time() - began,
          'peak_memory_gib': usage.ru_maxrss * 1024 / 2**30}  # ru_maxrss: KiB


def stored_bytes(prepared: str) -> dict:
  """The training split's stored token ids: pairs, tokens of both sides, bytes on disk."""
  for info in glob.glob(os.path.join(prepared, 'tokens', '*', 'info.json')):
    with open(info, encoding='utf-8') as f:
      stored = json.load(f)
    if stored['corpus'].endswith('(train)'):
      return {key: stored[key] for key in ('pairs', 'tokens', 'bytes')}
  raise RuntimeError(f'no stored training split in {prepared}')


def main(argv):
  del argv
  began = time.time()
  generate(FLAGS.data_dir, FLAGS.pairs)
  generate_secs = time.time() - began
  data = FLAGS.data_dir
  with tempfile.TemporaryDirectory() as work:
    config = ['--config=configs/wmt14.py:base,en-de', '--config.dataset=text',
              f'--config.train_files={data}/train.{{lang}}.gz',
              f'--config.validation_files={data}/validation.{{lang}}.gz',
              f'--config.test_files={data}/test.{{lang}}.gz', *SMALL_MODEL]
    train = lambda prepared, run, steps: timed_run('train.py', config + [
        f'--config.tfds_data_dir={work}/{prepared}', f'--workdir={work}/{run}',
        '--config.log_every_steps=1', '--config.eval_every_steps=0',
        '--config.bleu_every_steps=0', f'--config.compilation_cache_dir={work}/cache',
        f'--config.num_train_steps={steps}'])
    results = {
        'machine': machine(), 'pairs': FLAGS.pairs, 'generate_secs': generate_secs,
        'prepare': timed_run('prepare.py', config + [f'--config.tfds_data_dir={work}/a']),
        'stored': stored_bytes(f'{work}/a'),
        'first_start_prepared': train('a', 'prepared_run', 1),
        'first_start': train('b', 'run', 1),
        'resume': train('b', 'run', 2)}
  write_results(FLAGS.output, FLAGS.name, results, markdown(results))


def markdown(r: dict) -> str:
  cell = lambda x, name: f'{x[name]:.0f}' if name in x else '-'
  row = lambda name, x: (f'| {name} | {cell(x, "vocabulary")} | {cell(x, "tokens")} | '
                         f'{cell(x, "batches")} | {cell(x, "first_step")} | '
                         f'{x["total"]:.0f} | {x["peak_memory_gib"]:.1f} |')
  stored = r['stored']
  return '\n'.join([
      f'configs/wmt14.py:base,en-de (model shrunk) on {r["pairs"]:,} generated pairs '
      f'(dataset=text) on {machine_name(r["machine"])}: seconds from the process start to each '
      'point of its log, and its peak resident memory (`python -m benchmarks.wmt_scale`).',
      '',
      '| run | vocabulary ready (s) | training token ids ready (s) | training batches ready '
      '(s) | first step (s) | whole run (s) | peak memory (GiB) |',
      '| --- | --- | --- | --- | --- | --- | --- |',
      row('prepare.py (vocabulary trained, every split tokenized)', r['prepare']),
      row('train.py, first start, data prepared (compilation cache empty)',
          r['first_start_prepared']),
      row('train.py, first start, nothing prepared (compilation cached)', r['first_start']),
      row('train.py, resume (compilation cached)', r['resume']),
      '',
      f'Stored training token ids: {stored["pairs"]:,} pairs, {sum(stored["tokens"]):,} tokens, '
      f'{stored["bytes"] / 2**20:,.0f} MiB ({stored["bytes"] / sum(stored["tokens"]):.2f} bytes '
      'per token with the lengths).']) + '\n'


if __name__ == '__main__':  # flags here: the tests import generate() beside other benchmarks
  flags.DEFINE_integer('pairs', 4_500_000, 'Training pairs generated.')
  flags.DEFINE_string('data_dir', '/tmp/wmt_scale', 'Where the text files go.')
  flags.DEFINE_string('name', 'wmt_scale', 'Results go to <name>.json and <name>.md.')
  flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                      'Where the results go.')
  FLAGS = flags.FLAGS
  app.run(main)
