"""Translator: how sentences are split into beam-search calls, that the split changes nothing,
and its progress display."""

import io
import sys
import time

import numpy as np
import pytest
from flax import jax_utils

from configs import tiny
from transformer import config as config_lib
from transformer import data, train_step, translate
from transformer.translate import LENGTH_STEP, decode_batches


@pytest.mark.parametrize('budget,devices', [(64, 1), (100, 2), (1024, 4), (8, 3)])
def test_decode_batches_cover_every_sentence_once_in_one_shape_per_length(budget, devices):
  lengths = np.random.default_rng(budget).integers(1, 60, 500)
  batches = decode_batches(list(lengths), budget, devices)
  assert sorted(np.concatenate([indices for indices, _, _ in batches])) == list(range(500))
  rows_of_length = {}
  for n, (indices, rows, length) in enumerate(batches):
    assert rows & (rows - 1) == 0 and (rows * length <= budget or rows == 1)
    assert length % LENGTH_STEP == 0 and lengths[indices].max() <= length
    assert len(indices) == rows * devices or n == len(batches) - 1  # only the last call is short
    assert rows_of_length.setdefault(length, rows) == rows  # one compiled shape per length
  assert set(rows_of_length) <= set(-(-lengths // LENGTH_STEP) * LENGTH_STEP)


def untrained_translator(workdir) -> tuple[translate.Translator, dict, list[str]]:
  """A Translator of configs/tiny.py (beam 3) at its initial parameters, replicated, and 37
  validation sentences."""
  config = config_lib.validate(tiny.get_config())
  vocab = data.load_or_train_vocabulary(config, str(workdir))
  params = jax_utils.replicate(
      train_step.initial_state(config).params)
  sentences = data.split_texts(config, 'validation')[0][:37]
  return translate.Translator(config, vocab, beam_size=3, alpha=0.6), params, sentences


@pytest.mark.slow
def test_translations_do_not_depend_on_how_sentences_are_batched(tmp_path):
  translator, params, sentences = untrained_translator(tmp_path)
  outputs = {}
  lengths = [len(ids) + 1 for ids in translator.vocab.encode_batch(sentences)]
  for budget in (LENGTH_STEP, 4096):  # one sentence per device and call; all in one call
    translator.tokens_per_device = budget
    outputs[budget] = translator.translate(params, sentences)
    # Every shape of the plan compiled once, and nothing else.
    shapes = {(rows, length) for budget in outputs
              for _, rows, length in decode_batches(lengths, budget, translator.devices)}
    assert set(translator.programs.compiled) == shapes
  assert len(shapes) > 2
  assert len(outputs[4096]) == 37 and any(outputs[4096])
  assert outputs[LENGTH_STEP] == outputs[4096]


@pytest.mark.slow
def test_an_empty_or_blank_line_translates_to_an_empty_line(tmp_path):
  translator, params, sentences = untrained_translator(tmp_path)
  alone = translator.translate(params, sentences[:2])
  assert all(alone)  # the untrained model writes something for a sentence
  assert translator.translate(params, ['', sentences[0], ' \t ', sentences[1], '']) == [
      '', alone[0], '', alone[1], '']


@pytest.mark.slow
def test_the_programs_to_compile_ahead_are_the_searches_translating_takes(tmp_path):
  translator, params, sentences = untrained_translator(tmp_path)
  translator.tokens_per_device = 2 * LENGTH_STEP  # several calls, of several shapes
  searches = translator.search_programs(params, sentences)
  keys = [args[0] for args in searches]
  lengths = [len(ids) + 1 for ids in translator.vocab.encode_batch(sentences)]
  calls = decode_batches(lengths, translator.tokens_per_device, translator.devices)
  assert len(calls) > len(keys) > 1  # each shape once, though several calls share it
  assert sorted(keys) == sorted({(rows, length) for _, rows, length in calls})
  for args in searches:
    translator.programs.get(*args)
  translator.translate(params, sentences)
  assert sorted(translator.programs.compiled) == sorted(keys)  # translating compiled no more


@pytest.mark.slow
def test_hosts_each_translate_their_part_of_every_call_and_all_get_all(tmp_path, monkeypatch):
  # Two hosts played one after the other in this process, each with this process's devices; the
  # all-gather is played back from what the first round of both hosts left.
  translator, params, sentences = untrained_translator(tmp_path)
  translator.tokens_per_device = 4 * LENGTH_STEP
  alone = translator.search(params, sentences)
  translated, gathered = {}, {}

  def search_as(host, everyone=None):
    # One all-gather per output: ids, log-probabilities, scores.
    monkeypatch.setattr(translate.jax, 'process_count', lambda: 2)
    monkeypatch.setattr(translate.jax, 'process_index', lambda: host)
    monkeypatch.setattr(translate.multihost_utils, 'process_allgather',
                        lambda local: gathered.setdefault(host, []).append(local) or
                        np.stack([local, local]) if everyone is None else everyone.pop(0))
    searched = translator.programs.get
    monkeypatch.setattr(translator.programs, 'get', lambda *args: lambda p, batch, numbers: (
        translated.setdefault(host, []).append(batch) or searched(*args)(p, batch, numbers)))
    try:
      return translator.search(params, sentences)
    finally:
      monkeypatch.undo()

  for host in (0, 1):
    search_as(host)
  both = [np.stack(parts) for parts in zip(gathered[0], gathered[1])]
  assert len(both) == 3
  outputs = [search_as(host, list(both)) for host in (0, 1)]
  # Each call of the plan over both hosts' devices ran on both, each host's part on its own.
  lengths = [len(ids) + 1 for ids in translator.vocab.encode_batch(sentences)]
  calls = decode_batches(lengths, translator.tokens_per_device, 2 * translator.devices)
  assert sum(len(indices) for indices, _, _ in calls) == 37 and len(calls) > 1
  for host in (0, 1):
    assert [b.shape for b in translated[host]] == 2 * [
        (translator.devices, rows, length) for _, rows, length in calls]
  for host in (0, 1):
    for got, want in zip(outputs[host], alone):
      np.testing.assert_array_equal(np.trim_zeros(got[0][0], 'b'), np.trim_zeros(want[0][0], 'b'))
      np.testing.assert_allclose(got[2], want[2], rtol=1e-6)  # batched with other sentences


@pytest.mark.slow
def test_a_line_longer_than_the_model_takes_is_cut_with_a_warning_naming_it(tmp_path, caplog):
  config = config_lib.validate(tiny.get_config())
  limit = config.max_length
  vocab = data.load_or_train_vocabulary(config, str(tmp_path))
  params = jax_utils.replicate(train_step.initial_state(config).params)
  translator = translate.Translator(config, vocab, beam_size=2, alpha=0.6)
  short = data.split_texts(config, 'validation')[0][:2]
  long = ' '.join(short * 2000)  # thousands of tokens
  tokens = len(vocab.encode(long)) + 1
  began = time.time()
  with caplog.at_level('WARNING'):
    translations = translator.translate(params, ['', short[0], long, long + ' ' + short[1]])
  assert time.time() - began < 60
  assert [record.getMessage() for record in caplog.records] == [
      f'2 input line(s) have more than {limit} tokens (with EOS), the most config.max_length '
      f'lets through: line 3 ({tokens} tokens), line 4 ({tokens + len(vocab.encode(short[1]))} '
      f'tokens); each is translated from its first {limit} tokens only: split such lines into '
      'sentences']
  # Only the first tokens count: lines that share them translate alike, in short programs.
  assert translations[0] == '' and translations[2] == translations[3]
  assert max(length for _, length in translator.programs.compiled) <= max(limit, LENGTH_STEP)


def test_progress_is_a_bar_on_a_terminal(monkeypatch):
  class Terminal(io.StringIO):
    def isatty(self):
      return True

  terminal = Terminal()
  monkeypatch.setattr(sys, 'stderr', terminal)
  progress = translate.Progress(50)
  for _ in range(5):
    time.sleep(0.12)  # tqdm redraws at most every 0.1 s
    progress.update(10)
  progress.close()
  redraws = terminal.getvalue().split('\r')
  assert redraws[-1].startswith('100%') and '50/50' in redraws[-1], terminal.getvalue()
  assert any('20/50' in line for line in redraws) and 'sentence/s' in redraws[-1]
