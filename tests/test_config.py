"""Config files hold the paper's numbers; bad values fail early with one message naming the key."""

import dataclasses
import json
import os
import statistics

import pytest

from benchmarks import reproduce_multi30k
from configs import default, multi30k, tiny, wmt14
from transformer import config as config_lib
from transformer import stored_config
from transformer.model import TransformerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_CONFIGS = {
    'default': default.get_config,
    'wmt14:base,en-de': lambda: wmt14.get_config('base,en-de'),
    'wmt14:big,en-de': lambda: wmt14.get_config('big,en-de'),
    'wmt14:base,en-fr': lambda: wmt14.get_config('base,en-fr'),
    'wmt14:big,en-fr': lambda: wmt14.get_config('big,en-fr'),
    'multi30k': multi30k.get_config,
    'multi30k:en-fr': lambda: multi30k.get_config('en-fr'),
    'tiny': tiny.get_config,
}


@pytest.mark.parametrize('name', ALL_CONFIGS)
def test_every_config_file_is_valid(name):
  config = config_lib.validate(ALL_CONFIGS[name]())
  assert config_lib.model_config(config).vocab_size == config.vocab_size


def test_default_is_the_papers_base_recipe():
  c = default.get_config()
  assert (c.dataset, c.source_lang, c.target_lang, c.vocab_size) == (
      'wmt14_translate/de-en', 'en', 'de', 37000)
  m = c.model
  assert (m.d_model, m.d_ff, m.num_heads, m.num_encoder_layers, m.num_decoder_layers) == (
      512, 2048, 8, 6, 6)
  assert (m.dropout_rate, m.layer_norm, m.positional_encoding) == (0.1, 'post', 'sinusoidal')
  assert m.share_embeddings and m.tie_output_embedding
  assert (c.label_smoothing, c.adam_b1, c.adam_b2, c.adam_eps) == (0.1, 0.9, 0.98, 1e-9)
  assert (c.schedule, c.lr_scale, c.warmup_steps, c.num_train_steps) == ('paper', 1.0, 4000,
                                                                         100_000)
  assert c.tokens_per_batch == 25000 and c.grad_clip_norm == 0.0
  assert (c.beam_size, c.alpha, c.decode_extra_length) == (4, 0.6, 50)
  # Checkpoints 10 minutes of the paper's steps apart: 100k steps took 12 hours.
  assert (c.average_last, c.checkpoint_every_steps, c.checkpoint_every_secs) == (5, 1400, 0)
  assert wmt14.get_config('base,en-de').to_dict() == c.to_dict()


def test_big_and_en_fr_differ_where_the_paper_does():
  big = wmt14.get_config('big,en-de')
  assert (big.model.d_model, big.model.d_ff, big.model.num_heads) == (1024, 4096, 16)
  assert (big.model.dropout_rate, big.num_train_steps, big.average_last) == (0.3, 300_000, 20)
  assert (big.checkpoint_every_steps, big.checkpoint_every_secs) == (600, 0)  # 3.5 days / 300k
  big_fr = wmt14.get_config('big,en-fr')
  assert (big_fr.model.dropout_rate, big_fr.vocab_size, big_fr.target_lang) == (0.1, 32000, 'fr')
  assert big_fr.dataset == 'wmt14_translate/fr-en'
  base_fr = wmt14.get_config('base,en-fr')
  assert (base_fr.model.d_model, base_fr.model.dropout_rate, base_fr.vocab_size) == (512, 0.1,
                                                                                     32000)


@pytest.mark.parametrize('arg', ['huge,en-de', 'base,en-ru'])
def test_wmt14_rejects_unknown_arguments(arg):
  with pytest.raises(ValueError, match='configs/wmt14.py'):
    wmt14.get_config(arg)


BAD_VALUES = [
    ('model.num_heads', 7, 'divisible'),
    ('model.d_model', 511, 'even'),
    ('model.d_ff', 0, 'integer >= 1'),
    ('model.dropout_rate', -0.1, r'\[0.0, 1.0\)'),
    ('model.attention_dropout_rate', 1.0, r'\[0.0, 1.0\)'),
    ('model.layer_norm', 'middle', "'post', 'pre'"),
    ('model.positional_encoding', 'rotary', "'sinusoidal', 'learned'"),
    ('model.dtype', 'float64', "'float32'"),
    ('dataset', 'wmt99', 'unknown dataset'),
    ('target_lang', 'en', 'must differ'),
    ('label_smoothing', 1.5, r'\[0.0, 1.0\)'),
    ('num_train_steps', 0, 'integer >= 1'),
    ('final_bleu_splits', 'valid,test', "must be 'validation', 'test', both"),
    ('grad_accum_steps', 0, 'integer >= 1'),
    ('log_every_steps', -1, 'integer >= 0'),
    ('average_last', 9, 'keep_checkpoints'),
    ('schedule', 'cosine', "'paper'"),
    ('beam_size', 0, 'integer >= 1'),
    ('implementation.loss_chunk_tokens', -1, 'integer >= 0'),
    ('implementation.decode_batch_tokens', -1, 'integer >= 0'),
    ('compilation_cache_dir', None, 'directory or empty'),
    ('vocab_size', 259, '256 byte pieces and 3 special ids'),
    ('implementation.dropout_rng', 'philox', "'hash', 'rbg'"),
    ('implementation.loss_reduction', 'fused', "'separate', 'online'"),
    ('implementation.attention_projection', 'einsum', "'matrix', 'heads'"),
    ('xla_flags', 'xla_gpu_enable_triton_gemm=false', "'--xla_name=value'"),
    ('xla_flags', '--xla_gpu_autotune_level', "'--xla_name=value'"),
    ('implementation.attention', 'flash', "'xla', 'cudnn', 'pallas'"),
    ('tfds_data_dir', 'gs://bucket/tfds', 'mount the bucket'),
    ('compound_split_languages', None, 'comma-separated language codes'),
]


@pytest.mark.parametrize('key,value,message', BAD_VALUES)
def test_bad_values_name_their_key(key, value, message):
  config = default.get_config()
  node, leaf = config, key
  if '.' in key:
    section, leaf = key.split('.')
    node = config[section]
  with node.ignore_type():
    node[leaf] = value
  with pytest.raises(config_lib.ConfigError, match=rf'^config\.{key}={value!r}: .*{message}'):
    config_lib.validate(config)


def test_unknown_and_missing_keys_are_named():
  config = default.get_config()
  config.model.num_layers = 6
  with pytest.raises(config_lib.ConfigError, match=r'config\.model\.num_layers=6: unknown'):
    config_lib.validate(config)
  config = default.get_config()
  del config['warmup_steps']
  with pytest.raises(config_lib.ConfigError, match=r'config\.warmup_steps is missing'):
    config_lib.validate(config)


def test_multi30k_languages_are_checked():
  assert (multi30k.get_config().source_lang, multi30k.get_config().target_lang) == ('en', 'de')
  config = multi30k.get_config('en-fr')
  assert (config.source_lang, config.target_lang) == ('en', 'fr')
  config = multi30k.get_config('en-cs')
  with pytest.raises(config_lib.ConfigError, match=r"config\.target_lang='cs'"):
    config_lib.validate(config)
  with pytest.raises(ValueError, match=r"configs/multi30k.py:ende: the argument is a language "):
    multi30k.get_config('ende')


@pytest.mark.parametrize('languages,target,split', [
    ('de', 'de', True), ('de', 'fr', False), ('de,fr', 'fr', True), ('', 'de', False)])
def test_paper_bleu_splits_compounds_of_the_configured_languages(languages, target, split):
  config = multi30k.get_config(f'en-{target}')
  config.compound_split_languages = languages
  assert config_lib.compound_split(config, config.target_lang) == split


def test_the_table_of_keys_is_every_key_of_the_configs_and_the_model():
  flat = default.get_config().to_dict()
  keys = {f'{group}.{key}' for group, node in flat.items() if isinstance(node, dict)
          for key in node} | {key for key, value in flat.items() if not isinstance(value, dict)}
  assert keys == set(config_lib.KEYS)
  # The model's fields, but those each use of the model sets (vocab_size from the data).
  run_mode = {'vocab_size', 'deterministic', 'decode', 'attention_implementation',
              'attention_projection'}
  assert ({f'model.{f.name}' for f in dataclasses.fields(TransformerConfig)} - {
      f'model.{name}' for name in run_mode}) == {key for key in keys if key.startswith('model.')}
  config = default.get_config()
  config.learning_rate = 1e-3
  with pytest.raises(config_lib.ConfigError, match=r'^config\.learning_rate=0.001: unknown key'):
    config_lib.validate(config)


def _as_written_before(config, drop_added: bool) -> dict:
  """`config` as a config.json of the first version: the keys since moved (config.MOVED_KEYS)
  where they were, and (where `drop_added`) none of the keys added since."""
  stored = json.loads(config.to_json())
  moved_from = {new: old for old, new in stored_config.MOVED_KEYS.items()}
  for key, spec in config_lib.KEYS.items():
    group, _, leaf = key.rpartition('.')
    value = (stored[group] if group else stored).pop(leaf)
    if drop_added and spec.added is not config_lib.MISSING:
      continue
    old_group, _, old_leaf = moved_from.get(key, key).rpartition('.')
    (stored[old_group] if old_group else stored)[old_leaf] = value
  assert not stored.pop('implementation')
  return stored


@pytest.mark.parametrize('drop_added', [False, True])
def test_a_workdir_config_from_before_moved_and_added_keys_reads_as_this_version(tmp_path,
                                                                                drop_added):
  (tmp_path / 'config.json').write_text(json.dumps(_as_written_before(tiny.get_config(),
                                                                      drop_added)))
  # A run's: its vocabulary beside it binds the workdir to the config.
  (tmp_path / 'vocab').mkdir()
  (tmp_path / 'vocab' / 'sentencepiece.model').write_bytes(b'')
  config = stored_config.load_workdir_config(str(tmp_path))
  if not drop_added:
    assert config == tiny.get_config()
  added = {key: spec.added for key, spec in config_lib.KEYS.items()
           if spec.added is not config_lib.MISSING}
  assert len(added) == 18
  if drop_added:
    assert {key: config_lib._get(config, key) for key in added} == added
    assert (config.implementation.dropout_rng, config.implementation.loss_chunk_tokens) == (
        'hash', 0)  # moved, never added: every config.json holds them
  assert config_lib.model_config(config).attention_implementation == 'xla'
  tiny_config = tiny.get_config()
  stored_config.check_and_write(tiny_config, str(tmp_path))  # resumes: no conflicting key
  assert stored_config.load_workdir_config(str(tmp_path)) == tiny_config
  # How the model computes may change on resuming; what it computes may not.
  tiny_config.implementation.attention = 'xla'
  tiny_config.model.output_projection_dtype = 'bfloat16'
  stored_config.check_and_write(tiny_config, str(tmp_path))
  tiny_config.model.d_ff *= 2
  with pytest.raises(config_lib.ConfigError, match='config.model.d_ff=.* conflicts'):
    stored_config.check_and_write(tiny_config, str(tmp_path))


def test_a_workdir_config_naming_a_removed_implementation_reads_as_the_default(tmp_path):
  """The Pallas layer-norm and loss kernels were removed: a run that trained with them computes
  the same with XLA's, and resumes, evaluates and translates so."""
  stored = json.loads(tiny.get_config().to_json())
  stored['model']['norm_implementation'] = 'pallas'
  stored['implementation']['loss_reduction'] = 'pallas'
  (tmp_path / 'config.json').write_text(json.dumps(stored))
  config = stored_config.load_workdir_config(str(tmp_path))
  assert 'norm_implementation' not in config.model and config.implementation.loss_reduction == ''
  assert config == tiny.get_config()
  fresh = tiny.get_config()
  fresh.model.norm_implementation = 'pallas'
  with pytest.raises(config_lib.ConfigError, match="config.model.norm_implementation='pallas': "
                     'unknown model key'):
    config_lib.validate(fresh)


def _recipe_figures(rows: dict, pair: str) -> dict:
  """The seeds, mean minutes and BLEUs ('mean (lowest-highest)', or one run's) of the recipe's
  runs of `pair` scored on test."""
  recipes = [group for group in reproduce_multi30k.seed_groups(rows, min_seeds=1)
             if group[0]['pair'] == pair and not reproduce_multi30k.but_the_seed(group[0])]
  assert len(recipes) == 1, f'the {pair} recipe is scored on test on {len(recipes)} machines'
  runs = recipes[0]
  seeds = ', '.join(str(reproduce_multi30k.seed_of(r)) for r in runs)
  return dict(seeds=('seed ' if len(runs) == 1 else 'seeds ') + seeds,
              minutes=f'{statistics.mean(r["train_minutes"] for r in runs):.1f}',
              test=reproduce_multi30k.over_seeds(runs, 'test'),
              paper=reproduce_multi30k.over_seeds(runs, 'test', 'bleu_paper'),
              validation=reproduce_multi30k.over_seeds(runs, 'validation'))


def test_the_multi30k_config_quotes_its_measured_results():
  """The figures in configs/multi30k.py's docstring and the README's results table are those of
  the recipe's runs in benchmarks/results/multi30k.json, en-de and en-fr, over their seeds."""
  with open(os.path.join(ROOT, 'benchmarks', 'results', 'multi30k.json'), encoding='utf-8') as f:
    rows = json.load(f)
  docstring = ' '.join(multi30k.__doc__.split())
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    readme = f.read()
  for pair, config, quoted in [
      ('en-de', 'configs/multi30k.py', '{seeds}: {minutes} minutes of training; test2016 '
       'sacreBLEU {test} (paper BLEU {paper}), validation {validation};'),
      ('en-fr', 'configs/multi30k.py:en-fr', '(`--pair=en-fr`), {seeds}: {minutes} minutes, '
       'test2016 {test} ({paper}), validation {validation}.')]:
    figures = _recipe_figures(rows, pair)
    assert quoted.format(**figures) in docstring
    assert (f'| Multi30k, `{config}` | {pair} | test2016 | {figures["test"]} | '
            f'{figures["paper"]} | {figures["minutes"]} minutes |') in readme


@pytest.mark.parametrize('content, why', [
    ('list', 'holds a JSON list, not an object of config keys'),
    ('latin-1', 'is not UTF-8 text (invalid start byte at byte 14)'),
    ('directory', 'is a directory, not the file train.py writes'),
    ('truncated', 'is not valid JSON (Expecting'),
])
def test_a_malformed_config_json_gets_one_line_with_the_fix(tmp_path, content, why):
  path = tmp_path / 'config.json'
  if content == 'directory':
    path.mkdir()
  else:
    path.write_bytes({'list': b'[1, 2]', 'latin-1': '{"dataset": "m\xfcll"}'.encode('latin-1'),
                      'truncated': b'{"dataset": '}[content])
  with pytest.raises(config_lib.ConfigError) as raised:
    stored_config.load_workdir_config(str(tmp_path))
  assert str(raised.value).startswith(f'{path} {why}')
  assert str(raised.value).endswith('restore it from the config file the run was started with')
