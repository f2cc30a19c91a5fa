"""Data prepared once: token ids stored per (source, vocabulary), prepare.py, and what a failed
download says."""

import fcntl
import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import requests
import tensorflow_datasets as tfds
from tensorflow_datasets.core.download import downloader

from configs import default, multi30k
from conftest import ROOT, error_line, run_script
from test_data import text_config
from transformer import config as config_lib
from transformer import data
from transformer.data import prepare, sources, token_store, vocabulary


@pytest.fixture
def text_run(tmp_path):
  """A dataset='text' config with its own prepared-data directory, and its vocabulary."""
  config = text_config(tmp_path, tfds_data_dir=str(tmp_path / 'prepared'))
  return config, data.load_or_train_vocabulary(config, str(tmp_path / 'run'))


def said(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records]


def test_token_ids_are_stored_once_and_read_back_without_the_text(text_run, monkeypatch, caplog):
  config, vocab = text_run
  corpus = sources.load_split(config, 'train')
  with caplog.at_level(logging.INFO, logger='absl'):
    stored = token_store.load_or_tokenize(config, corpus, vocab)
  directory = token_store.store_dir(config, corpus, vocab)
  assert any(re.fullmatch(rf'.*: 600 pairs tokenized in [\d.]+ s, stored in {directory} .*', m)
             for m in said(caplog))
  assert sorted(os.listdir(directory)) == ['info.json', 'source_lengths.npy', 'source_tokens.npy',
                                           'target_lengths.npy', 'target_tokens.npy']
  info = json.loads(pathlib.Path(directory, 'info.json').read_text())
  assert (info['pairs'], info['corpus_digest']) == (600, corpus.digest)
  # Every pair's ids are the vocabulary's, each side ending in EOS, in corpus order.
  texts = corpus.texts(range(len(corpus)))
  for k in range(600):
    for ragged, text in zip((stored.sources, stored.targets), texts):
      assert ragged[k].tolist() == vocab.encode(text[k]) + [data.EOS_ID]
  assert stored.sources.flat.dtype == np.uint16  # 352 pieces fit
  assert token_store.token_dtype(2**16) == np.uint16 and token_store.token_dtype(2**16 + 1) == (
      np.int32)

  # Read back: neither the text nor the tokenizer is used.
  def fail(*args, **kwargs):
    raise AssertionError('read the text or tokenized again')

  monkeypatch.setattr(sources.Corpus, 'texts', fail)
  monkeypatch.setattr(vocabulary.Vocabulary, 'encode_batch', fail)
  caplog.clear()
  with caplog.at_level(logging.INFO, logger='absl'):
    again = token_store.load_or_tokenize(config, sources.load_split(config, 'train'), vocab)
  assert said(caplog) == [f'{corpus.name}: token ids read from {directory}']
  for old, new in ((stored.sources, again.sources), (stored.targets, again.targets)):
    np.testing.assert_array_equal(old.flat, new.flat)
    np.testing.assert_array_equal(old.lengths, new.lengths)
  data.train_batches(config, vocab, num_devices=2)  # the batcher reads the store too


def test_a_changed_source_or_vocabulary_is_tokenized_anew(text_run, tmp_path):
  config, vocab = text_run
  corpus = sources.load_split(config, 'train')
  token_store.load_or_tokenize(config, corpus, vocab)
  lines = (tmp_path / 'train.de').read_text().splitlines()
  lines[5] = 'GEÄNDERT'
  (tmp_path / 'train.de').write_text(''.join(f'{line}\n' for line in lines))
  changed = sources.load_split(config, 'train')
  assert changed.digest != corpus.digest
  assert token_store.store_dir(config, changed, vocab) != token_store.store_dir(config, corpus,
                                                                                vocab)
  tokenized = token_store.load_or_tokenize(config, changed, vocab)
  assert tokenized.targets[5].tolist() == vocab.encode('GEÄNDERT') + [data.EOS_ID]
  # Another vocabulary of the same text has its own store.
  other = config.copy_and_resolve_references()
  other.vocab_size = 320
  other_vocab = data.Vocabulary(vocabulary.train_model(other, changed))
  assert token_store.store_dir(config, changed, other_vocab) != token_store.store_dir(
      config, changed, vocab)


def test_a_store_left_incomplete_is_written_again(text_run, caplog):
  config, vocab = text_run
  corpus = sources.load_split(config, 'validation')
  first = token_store.load_or_tokenize(config, corpus, vocab)
  directory = token_store.store_dir(config, corpus, vocab)
  os.remove(os.path.join(directory, 'info.json'))  # as if the run stopped before writing it
  with open(os.path.join(directory, 'source_tokens.npy'), 'wb') as f:
    f.write(b'half a file')
  with caplog.at_level(logging.INFO, logger='absl'):
    again = token_store.load_or_tokenize(config, corpus, vocab)
  assert any('pairs tokenized in' in m for m in said(caplog))
  np.testing.assert_array_equal(again.sources.flat, first.sources.flat)
  assert sorted(os.listdir(directory)) == ['info.json', 'source_lengths.npy', 'source_tokens.npy',
                                           'target_lengths.npy', 'target_tokens.npy']


@pytest.mark.slow
def test_prepare_then_a_run_reads_the_vocabulary_and_token_ids(tmp_path, caplog):
  """prepare.py on dataset='text' files; a run in a new workdir then prepares nothing."""
  prepared = tmp_path / 'prepared'
  config = text_config(tmp_path, tfds_data_dir=str(prepared))  # writes the files
  result = run_script('prepare.py', '--config=configs/tiny.py', '--config.dataset=text',
                      f'--config.train_files={config.train_files}',
                      f'--config.validation_files={config.validation_files}',
                      '--config.vocab_size=352', f'--config.tfds_data_dir={prepared}')
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert re.fullmatch(rf'vocabulary \(352 pieces\): {prepared}/vocabularies/\w+/'
                      'sentencepiece.model', lines[0])
  assert [line.split(':')[0] for line in lines[1:]] == [
      f'{tmp_path}/train.{{lang}} (train)', f'{tmp_path}/validation.{{lang}} (validation)']
  assert re.search(r': 600 pairs, [\d,]+ tokens: ', lines[1])
  assert 'tokenized' in result.stderr

  with caplog.at_level(logging.INFO, logger='absl'):
    assert prepare.prepare(config) == lines  # again: all there already
    vocab = data.load_or_train_vocabulary(config, str(tmp_path / 'run'))  # as train.py starts
    data.train_batches(config, vocab, num_devices=2)
    list(data.eval_batches(config, vocab, 'validation', num_devices=2))
  messages = said(caplog)
  assert not [m for m in messages if 'tokenized' in m or 'vocabulary trained' in m]
  assert sum('vocabulary read from' in m for m in messages) == 2
  assert sum('token ids read from' in m for m in messages) == 4  # prepare, then the run


def test_prepare_a_tfds_dataset_with_mock_data(tmp_path):
  config = default.get_config()
  config.update(vocab_size=320, max_length=32, tokens_per_batch=256, vocab_sample_size=200,
                tfds_data_dir=str(tmp_path))
  config_lib.validate(config)
  with tfds.testing.mock_data(num_examples=120):
    summary = prepare.prepare(config)
    assert summary[0].startswith(f'vocabulary (320 pieces): {tmp_path}/vocabularies/')
    assert [line.split(':')[0] for line in summary[1:]] == [
        f'wmt14_translate/de-en ({split})' for split in ('train', 'validation', 'test')]
    vocab = data.load_or_train_vocabulary(config, str(tmp_path / 'run'))
    for split in ('train', 'validation', 'test'):
      corpus = sources.load_split(config, split)
      assert os.path.exists(os.path.join(token_store.store_dir(config, corpus, vocab),
                                         'info.json'))


def no_network(url, **kwargs):
  raise requests.ConnectionError(f'no route to {url}')


def test_a_failed_download_names_the_files_to_fetch_by_hand(tmp_path, monkeypatch):
  monkeypatch.setattr(downloader, '_open_url', no_network)
  config = default.get_config()
  config.update(tfds_data_dir=str(tmp_path / 'tfds'))
  with pytest.raises(data.DataError) as error:
    prepare.prepare(config)
  message = str(error.value)
  assert message.startswith('wmt14_translate/de-en/1.0.0: a download failed (ConnectionError: '
                            'no route to http')
  assert 'fetch its files by hand into one directory DIR, keeping their names' in message
  assert message.endswith('; pass --config.manual_dir=DIR')
  for url in ('http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz (77 MiB)',
              'http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz (876 MiB)',
              'http://data.statmt.org/wmt19/translation-task/dev.tgz (37 MiB)'):
    assert url in message

  # Files put in manual_dir are taken instead, and checked against TFDS's checksums.
  manual = tmp_path / 'manual'
  manual.mkdir()
  for name in ('dev.tgz', 'training-parallel-commoncrawl.tgz', 'training-parallel-europarl-v7.tgz',
               'training-parallel-nc-v9.tgz', 'wiki-titles.tgz'):
    (manual / name).write_bytes(b'not the archive')
  config.manual_dir = str(manual)
  with pytest.raises(data.DataError, match=re.escape(
      f'does not match its registered checksum (check the copies in config.manual_dir='
      f"'{manual}'")):
    prepare.prepare(config)


def test_a_failed_multi30k_download_names_the_files_to_fetch_by_hand(tmp_path, monkeypatch):
  # The download manager itself fails: with `_open_url` patched, its threads would go on fetching
  # the other files after the test, through the network.
  monkeypatch.setattr(tfds.download.DownloadManager, 'download',
                      lambda manager, urls: no_network(next(iter(urls.values()))))
  config = multi30k.get_config()
  config.update(tfds_data_dir=str(tmp_path))
  with pytest.raises(data.DataError) as error:
    prepare.prepare(config)
  message = str(error.value)
  assert message.startswith('multi30k: a download failed (ConnectionError: no route to https://')
  assert message.endswith(
      '; fetch train.en.gz, train.de.gz, train.fr.gz, val.en.gz, val.de.gz, val.fr.gz, '
      'test_2016_flickr.en.gz, test_2016_flickr.de.gz, test_2016_flickr.fr.gz by hand from '
      'https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/ into one '
      'directory DIR; pass --config.manual_dir=DIR')


@pytest.mark.slow
def test_prepare_py_says_what_is_wrong_in_one_line(tmp_path):
  result = run_script('prepare.py', '--config=configs/tiny.py', '--config.dataset=text',
                      f'--config.train_files={tmp_path}/absent.{{lang}}')
  assert error_line(result) == (f'prepare.py: {tmp_path}/absent.en: no such file; check '
                                'config.train_files (one sentence per line, optional .gz)')
  file = tmp_path / 'file'
  file.write_text('', encoding='utf-8')
  result = run_script('prepare.py', '--config=configs/tiny.py', f'--config.tfds_data_dir={file}')
  assert error_line(result) == (f'prepare.py: config.tfds_data_dir: {file} cannot be made a '
                                'directory (a file of that name exists); give a directory path')


@pytest.mark.slow
def test_a_read_only_prepared_data_directory_gets_one_line(tmp_path):
  line = (re.escape("config.tfds_data_dir='/sys': prepared data cannot be written there "
                    '(/sys/vocabularies/') + r'\w+' +
          re.escape('/sentencepiece.model could not be written (Operation not permitted)); give a '
                    'directory this user can write to, or one that holds the data prepared '
                    'already'))
  # /sys: read-only, even for root.
  assert re.fullmatch(f'prepare.py: {line}', error_line(run_script(
      'prepare.py', '--config=configs/tiny.py', '--config.tfds_data_dir=/sys')))
  assert re.fullmatch(f'train.py: {line}', error_line(run_script(
      'train.py', '--config=configs/tiny.py', '--config.tfds_data_dir=/sys',
      f'--workdir={tmp_path}/run')))
  # What binds nothing: the next start with a writable directory takes the workdir.
  assert sorted(os.listdir(tmp_path / 'run')) == ['config.json', 'run.lock']


@pytest.mark.slow
def test_processes_preparing_one_dataset_at_once_wait_for_each_other(tmp_path, multi30k_dir):
  """Hosts, or two commands, that share a fresh tfds_data_dir: one prepares Multi30k while the
  others wait, then read it; TFDS alone fails all but the first to finish."""
  command = [sys.executable, 'prepare.py', '--config=configs/multi30k.py',
             f'--config.tfds_data_dir={tmp_path}', f'--config.manual_dir={multi30k_dir}']
  with open(tmp_path / 'prepare.lock', 'a') as lock:  # as another process preparing
    fcntl.flock(lock, fcntl.LOCK_EX)
    waiting = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in waiting.stderr:
      if 'waiting for another process that prepares data in' in line:
        break
    assert waiting.poll() is None
    racing = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
  outputs = [process.communicate(timeout=600) for process in (waiting, racing)]
  assert [process.returncode for process in (waiting, racing)] == [0, 0], outputs
  assert len(os.listdir(tmp_path / 'multi30k_sources')) == 1
  assert sum('preparing multi30k from' in stderr for _, stderr in outputs) == 1
