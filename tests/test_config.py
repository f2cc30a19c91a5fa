"""Config files hold the paper's numbers; bad values fail early with one message naming the key."""

import json
import os
import re
import subprocess
import sys
import types

import pytest
from absl import flags
from ml_collections import config_flags

from configs import default, multi30k, tiny, wmt14
from transformer import config as config_lib
from transformer import trainer

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


def _gpu(kind: str, capability: str | None = None) -> types.SimpleNamespace:
  """A GPU device as jax describes it: its kind and, where it has one, its compute capability."""
  device = types.SimpleNamespace(device_kind=kind)
  if capability is not None:
    device.compute_capability = capability
  return device


H100 = _gpu('NVIDIA H100 80GB HBM3', '9.0')


def _on(monkeypatch, backend: str, device=H100):
  """The config's by-backend choices as on `backend`, whose devices, on a 'gpu', are `device`."""
  monkeypatch.setattr(config_lib.jax, 'default_backend', lambda: backend)
  if backend == 'gpu':
    monkeypatch.setattr(config_lib.jax, 'devices', lambda *args: [device])


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
    ('grad_accum_steps', 0, 'integer >= 1'),
    ('log_every_steps', -1, 'integer >= 0'),
    ('average_last', 9, 'keep_checkpoints'),
    ('schedule', 'cosine', "'paper'"),
    ('beam_size', 0, 'integer >= 1'),
    ('loss_chunk_tokens', -1, 'integer >= 0'),
    ('decode_batch_tokens', -1, 'integer >= 0'),
    ('compilation_cache_dir', None, 'directory or empty'),
    ('vocab_size', 259, '256 byte pieces and 3 special ids'),
    ('dropout_rng_impl', 'philox', "'hash', 'rbg'"),
    ('loss_reduction', 'fused', "'separate', 'online', 'pallas'"),
    ('attention_projection', 'einsum', "'matrix', 'heads'"),
    ('xla_flags', 'xla_gpu_enable_triton_gemm=false', "'--xla_name=value'"),
    ('xla_flags', '--xla_gpu_autotune_level', "'--xla_name=value'"),
    ('model.attention_implementation', 'flash', "'xla', 'cudnn', 'pallas'"),
    ('model.norm_implementation', 'triton', "'xla', 'pallas'"),
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


def run_script(*args):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)


@pytest.mark.parametrize('script,flag_names', [
    ('train.py', ['--config', '--workdir', '--coordinator_address', '--num_processes',
                  '--process_id']),
    ('eval.py', ['--workdir', '--split', '--source_file', '--reference_file', '--average_last',
                 '--beam_size', '--alpha', '--output_dir']),
])
def test_entry_points_print_help(script, flag_names):
  result = run_script(script, '--help')
  assert result.returncode == 1 and not result.stderr  # absl's --help exits with status 1
  for flag in flag_names:
    assert flag + ':' in result.stdout


@pytest.mark.parametrize('override,message', [
    ('--config.model.num_heads=3', 'config.model.num_heads=3: model.d_model=32 must be divisible'),
    ('--config.model.num_haeds=3', "--config.model.num_haeds=3: no key 'num_haeds' in the config. "
                                   'Did you mean "num_heads" instead of "num_haeds"?'),
])
def test_train_py_reports_a_bad_override_in_one_line(override, message):
  result = run_script('train.py', '--config=configs/tiny.py', '--workdir=unused', override)
  assert result.returncode != 0
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith(f'train.py: {message}')


MULTI_HOST = ('--num_processes=1', '--process_id=0')


@pytest.mark.parametrize('script,args,line', [
    ('train.py', ('--num_processes=2',),
     '--coordinator_address, --num_processes and --process_id go together'),
    ('train.py', ('--coordinator_address=localhost:1234', '--num_processes=0', '--process_id=0'),
     '--num_processes=0 must be >= 1'),
    ('train.py', ('--coordinator_address=localhost:1234', '--num_processes=2', '--process_id=2'),
     '--process_id=2 must be in [0, --num_processes=2)'),
    ('train.py', ('--coordinator_address=localhost', *MULTI_HOST),
     '--coordinator_address=localhost must be HOST:PORT of process 0, e.g. 10.0.0.1:1234'),
    ('train.py', ('--coordinator_address=localhost:99999', *MULTI_HOST),
     '--coordinator_address=localhost:99999 must be HOST:PORT of process 0, e.g. 10.0.0.1:1234'),
    # .invalid never resolves (RFC 6761): without the check JAX waits 5 minutes, then aborts.
    ('train.py', ('--coordinator_address=coordinator.invalid:1234', *MULTI_HOST),
     '--coordinator_address=coordinator.invalid:1234: host coordinator.invalid is unknown ('),
    ('eval.py', ('--beam_size=0',),
     'FATAL Flags parsing error: flag --beam_size=0: 0 is not a positive integer'),
    ('eval.py', ('--alpha=-0.5',), 'FATAL Flags parsing error: flag --alpha=-0.5: must be a '
                                   'finite number >= 0 (0: no length penalty)'),
    ('translate.py', ('--alpha=nan',), 'FATAL Flags parsing error: flag --alpha=nan: must be a '
                                       'finite number >= 0 (0: no length penalty)'),
])
def test_commands_report_bad_flags_in_one_line(script, args, line, tmp_path):
  required = {'train.py': ('--config=configs/tiny.py', f'--workdir={tmp_path}'),
              'eval.py': (f'--workdir={tmp_path}', f'--output_dir={tmp_path}'),
              'translate.py': (f'--workdir={tmp_path}',)}[script]
  result = run_script(script, *required, *args)
  assert result.returncode != 0 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  # absl's flag errors end with a line pointing to --helpshort.
  assert any(found.startswith(line) for found in result.stderr.strip().splitlines()[-2:]), (
      result.stderr[-3000:])


def parse_config_flag(*args):
  argv = ['train.py', *args]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  assert config_lib.parse_flags(argv, flag_values) == ['train.py']
  return flag_values.config


@pytest.mark.parametrize('args,message', [
    (['--config=configs/multi30k.py', '--config.model.d_modl=3'],
     '--config.model.d_modl=3: no key \'d_modl\' in the config. Did you mean "d_model" instead of '
     '"d_modl"?'),
    (['--config=configs/multi30k.py', '--config.vocab_size=8000', '--config.modl.d_ff=3'],
     "--config.modl.d_ff=3: no key 'modl' in the config. "
     'Did you mean "model" instead of "modl"?'),
    (['--config=configs/multi30k.py:ende'],
     "configs/multi30k.py:ende: the argument is a language pair such as 'en-de' or 'en-fr'"),
    (['--config=configs/default.py:big'],
     '--config=configs/default.py:big: get_config() takes 0 positional arguments but 1 was given'),
    (['--config=configs/multi3k.py', '--config.seed=1'],
     "--config=configs/multi3k.py: [Errno 2] No such file or directory: 'configs/multi3k.py'"),
])
def test_config_flag_mistakes_are_one_line(monkeypatch, args, message):
  monkeypatch.chdir(ROOT)
  with pytest.raises(config_lib.ConfigError) as error:
    parse_config_flag(*args)
  assert str(error.value) == message


def test_config_flag_argument_and_overrides_parse(monkeypatch):
  monkeypatch.chdir(ROOT)
  config = parse_config_flag('--config=configs/multi30k.py:en-fr', '--config.model.d_ff=768')
  assert (config.target_lang, config.model.d_ff) == ('fr', 768)


@pytest.mark.parametrize('backend', ['cpu', 'gpu', 'tpu'])
def test_loss_and_decode_batch_default_by_backend(monkeypatch, backend):
  _on(monkeypatch, backend)
  config = multi30k.get_config()
  assert (config.loss_chunk_tokens, config.decode_batch_tokens) == (0, 0)
  on_cpu = backend == 'cpu'
  assert config_lib.loss_chunk(config) == (256 if on_cpu else None)
  devices = config_lib.jax.local_device_count()
  assert config_lib.decode_batch_tokens(config) == (1950 // devices if on_cpu else 2**17)
  assert config_lib.loss_reduction(config) == ('online' if backend == 'gpu' else 'separate')
  assert config_lib.model_config(config).attention_projection == ('heads' if on_cpu else 'matrix')
  config.attention_projection = 'matrix'
  assert config_lib.model_config(config).attention_projection == 'matrix'
  config.update(loss_chunk_tokens=512, decode_batch_tokens=4096)
  assert (config_lib.loss_chunk(config), config_lib.decode_batch_tokens(config)) == (512, 4096)
  for reduction in ('separate', 'online'):
    config.loss_reduction = reduction
    assert config_lib.loss_reduction(config) == reduction


@pytest.mark.parametrize('backend', ['cpu', 'gpu'])
def test_the_fused_loss_is_chosen_only_where_its_kernel_runs(monkeypatch, backend):
  _on(monkeypatch, backend)
  config = default.get_config()
  config.loss_reduction = 'pallas'
  if backend == 'gpu':
    assert config_lib.loss_reduction(config) == 'pallas'
  else:
    with pytest.raises(config_lib.ConfigError, match=r"loss_reduction='pallas'.*cpu.*'online'"):
      config_lib.loss_reduction(config)
  _on(monkeypatch, 'gpu')
  config.loss_chunk_tokens = 256
  with pytest.raises(config_lib.ConfigError,
                     match=r"loss_reduction.*loss_chunk_tokens=0 \(now 256"):
    config_lib.loss_reduction(config)


@pytest.mark.parametrize('backend,device,runs', [
    ('gpu', H100, True),
    ('gpu', _gpu('NVIDIA A100-SXM4-40GB', '8.0'), True),
    ('gpu', _gpu('NVIDIA RTX PRO 6000', '12.0'), True),
    ('gpu', _gpu('Tesla T4', '7.5'), False),
    ('gpu', _gpu('Tesla V100-SXM2-16GB', '7.0'), False),
    ('gpu', _gpu('AMD Instinct MI250X', 'gfx90a'), False),
    ('gpu', _gpu('a GPU without a capability'), False),
    ('cpu', None, False), ('tpu', None, False)])
def test_the_fused_kernels_are_chosen_on_nvidia_gpus_from_ampere(monkeypatch, backend, device,
                                                                 runs):
  _on(monkeypatch, backend, device)
  assert config_lib.fused_kernels_run() is runs
  config = default.get_config()
  config.max_length = 128  # rows the Pallas attention takes
  assert config_lib.model_config(config).attention_implementation == ('pallas' if runs else 'xla')
  config.max_length = 256
  assert config_lib.model_config(config).attention_implementation == ('cudnn' if runs else 'xla')
  if runs:
    return
  capability = getattr(device, 'compute_capability', 'unknown')
  here = f'{device.device_kind}, compute capability {capability}' if device else backend
  needs = rf'an NVIDIA GPU of compute capability 8.0 or later \(here: {re.escape(here)}\)'
  for key, value in (('model.attention_implementation', 'cudnn'),
                     ('model.norm_implementation', 'pallas'), ('loss_reduction', 'pallas')):
    wrong = default.get_config()
    node, leaf = (wrong.model, key[6:]) if key.startswith('model.') else (wrong, key)
    node[leaf] = value
    check = config_lib.loss_reduction if key == 'loss_reduction' else config_lib.model_config
    with pytest.raises(config_lib.ConfigError, match=rf"{key}='{value}'.*{needs}"):
      check(wrong)
  stored = default.get_config()  # a run trained on an H100 translates here with XLA's
  stored.update(max_length=128)
  stored.model.update(attention_implementation='pallas', norm_implementation='pallas')
  here_config = config_lib.model_config(config_lib.for_this_backend(stored))
  assert (here_config.attention_implementation, here_config.norm_implementation) == ('xla', 'xla')


@pytest.mark.parametrize('backend', ['cpu', 'gpu', 'tpu'])
def test_attention_implementation_by_backend(monkeypatch, backend):
  _on(monkeypatch, backend)
  on_gpu = backend == 'gpu'
  base, small = default.get_config(), multi30k.get_config()  # bfloat16, float32
  assert config_lib.model_config(base).attention_implementation == ('cudnn' if on_gpu else 'xla')
  assert config_lib.model_config(small).attention_implementation == 'xla'
  base.max_length = 128  # rows the Pallas kernels take
  assert config_lib.model_config(base).attention_implementation == ('pallas' if on_gpu else 'xla')
  base.model.d_model = 768  # heads of 96: cuDNN's, not a power of 2
  assert config_lib.model_config(base).attention_implementation == ('cudnn' if on_gpu else 'xla')
  base.model.d_model = 512
  base.model.attention_implementation = 'xla'
  assert config_lib.model_config(base).attention_implementation == 'xla'
  base.model.update(attention_implementation='', attention_dropout_rate=0.1)
  assert config_lib.model_config(base).attention_implementation == 'xla'
  small.model.attention_implementation = 'cudnn'
  with pytest.raises(config_lib.ConfigError, match=r"model.attention_implementation='cudnn'.*"
                     r"float32.*use 'xla'"):
    config_lib.model_config(small)
  del small.model.attention_implementation  # a config.json from before the key: by backend
  assert config_lib.model_config(small).attention_implementation == 'xla'


@pytest.mark.parametrize('backend', ['cpu', 'gpu'])
def test_a_stored_run_keeps_only_the_implementations_this_backend_runs(monkeypatch, backend):
  _on(monkeypatch, backend)
  stored = default.get_config()
  stored.update(max_length=128)
  stored.model.update(attention_implementation='pallas', norm_implementation='pallas')
  here = config_lib.for_this_backend(stored)
  kept = backend == 'gpu'
  assert here.model.attention_implementation == ('pallas' if kept else '')
  assert here.model.norm_implementation == ('pallas' if kept else 'xla')
  assert config_lib.model_config(here).attention_implementation == ('pallas' if kept else 'xla')
  assert stored.model.norm_implementation == 'pallas'  # the stored config itself is unchanged
  assert here.to_dict() | {'model': None} == stored.to_dict() | {'model': None}


@pytest.mark.parametrize('change,wrong', [
    ({}, None), ({'model.dtype': 'float32'}, 'float32'), ({'max_length': 256}, 'now 256'),
    ({'model.attention_dropout_rate': 0.1}, 'now 0.1'), ({'model.d_model': 768}, 'now 96'),
    ({'model.num_heads': 64}, 'now 8')])
def test_the_fused_attention_is_chosen_only_where_its_kernels_run(monkeypatch, change, wrong):
  _on(monkeypatch, 'gpu')
  config = default.get_config()
  config.update(max_length=128)  # the default's 256 is longer than the kernels' rows
  config.model.attention_implementation = 'pallas'
  for key, value in change.items():
    node, leaf = (config.model, key[6:]) if key.startswith('model.') else (config, key)
    node[leaf] = value
  if wrong is None:
    assert config_lib.model_config(config).attention_implementation == 'pallas'
  else:
    with pytest.raises(config_lib.ConfigError,
                       match=rf"model.attention_implementation='pallas'.*{wrong}.*use 'xla'"):
      config_lib.model_config(config)
  _on(monkeypatch, 'cpu')
  with pytest.raises(config_lib.ConfigError, match=r"\(here: cpu\)"):
    config_lib.model_config(config)


@pytest.mark.parametrize('backend', ['cpu', 'gpu'])
def test_the_fused_layer_norm_is_chosen_only_where_its_kernels_run(monkeypatch, backend):
  _on(monkeypatch, backend)
  config = default.get_config()
  assert config_lib.model_config(config).norm_implementation == 'xla'
  config.model.norm_implementation = 'pallas'
  if backend == 'gpu':
    assert config_lib.model_config(config).norm_implementation == 'pallas'
  else:
    with pytest.raises(config_lib.ConfigError, match=r"norm_implementation='pallas'.*cpu.*'xla'"):
      config_lib.model_config(config)
  _on(monkeypatch, 'gpu')
  for key, value, named in (('layer_norm', 'pre', "'pre'"), ('d_model', 384, '384')):
    changed = default.get_config()
    changed.model.update({'norm_implementation': 'pallas', key: value})
    with pytest.raises(config_lib.ConfigError, match=f'norm_implementation.*now {named}'):
      config_lib.model_config(changed)
  del config.model.norm_implementation  # a config.json from before the key
  assert config_lib.model_config(config).norm_implementation == 'xla'


@pytest.mark.parametrize('languages,target,split', [
    ('de', 'de', True), ('de', 'fr', False), ('de,fr', 'fr', True), ('', 'de', False)])
def test_paper_bleu_splits_compounds_of_the_configured_languages(languages, target, split):
  config = multi30k.get_config(f'en-{target}')
  config.compound_split_languages = languages
  assert config_lib.compound_split(config) == split


def test_a_workdir_config_from_before_added_keys_gets_their_defaults(tmp_path):
  stored = json.loads(tiny.get_config().to_json())
  for key in config_lib.ADDED_KEYS:
    del stored[key]
  for key in trainer.IMPLEMENTATION_KEYS:  # added to the model's keys
    del stored['model'][key]
  (tmp_path / 'config.json').write_text(json.dumps(stored))
  # A run's: its vocabulary beside it binds the workdir to the config.
  (tmp_path / 'vocab').mkdir()
  (tmp_path / 'vocab' / 'sentencepiece.model').write_bytes(b'')
  config = config_lib.load_workdir_config(str(tmp_path))
  assert {key: config[key] for key in config_lib.ADDED_KEYS} == config_lib.ADDED_KEYS
  assert config_lib.model_config(config).norm_implementation == 'xla'
  tiny_config = tiny.get_config()
  trainer.check_and_write_config(tiny_config, str(tmp_path))  # resumes: no conflicting key
  assert config_lib.load_workdir_config(str(tmp_path)) == tiny_config
  # How the model computes may change on resuming; what it computes may not.
  tiny_config.model.update(norm_implementation='pallas', attention_implementation='xla')
  trainer.check_and_write_config(tiny_config, str(tmp_path))
  tiny_config.model.d_ff *= 2
  with pytest.raises(config_lib.ConfigError, match='config.model.d_ff=.* conflicts'):
    trainer.check_and_write_config(tiny_config, str(tmp_path))


def test_the_multi30k_config_quotes_its_measured_results():
  """The figures in configs/multi30k.py's docstring and the README's results table are those of
  the recipe's rows in benchmarks/results/multi30k.json, en-de and en-fr."""
  with open(os.path.join(ROOT, 'benchmarks', 'results', 'multi30k.json'), encoding='utf-8') as f:
    rows = json.load(f)
  docstring = ' '.join(multi30k.__doc__.split())
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    readme = f.read()
  recipe, recipe_en_fr = rows['recipe'], rows['recipe_en-fr']
  for row, config, quoted in [
      (recipe, 'configs/multi30k.py', '{minutes} minutes of training; test2016 sacreBLEU {test} '
       '(paper BLEU {paper}), validation {validation};'),
      (recipe_en_fr, 'configs/multi30k.py:en-fr', '(`--pair=en-fr`): {minutes} minutes, test2016 '
       '{test} ({paper}), validation {validation}.')]:
    test, validation = row['splits']['test'], row['splits']['validation']
    figures = dict(minutes=f'{row["train_minutes"]:.1f}', test=f'{test["sacrebleu"]:.2f}',
                   paper=f'{test["bleu_paper"]:.2f}', validation=f'{validation["sacrebleu"]:.2f}')
    assert quoted.format(**figures) in docstring
    assert (f'| Multi30k, `{config}` | {row["pair"]} | test2016 | {figures["test"]} | '
            f'{figures["paper"]} | {figures["minutes"]} minutes |') in readme


@pytest.mark.parametrize('xla_flags, reason', [
    ('--xla_gpu_autotune_level=2 --xla_no_such_flag=1',
     'Unknown flag in XLA_FLAGS: --xla_no_such_flag=1'),
    ('--xla_gpu_autotune_level=high', "Couldn't interpret value high for flag "
     'xla_gpu_autotune_level'),
    ('--xla_gpu_enable_triton_gemm=no', "Couldn't interpret value no for flag "
     'xla_gpu_enable_triton_gemm'),
])
def test_xla_flags_that_xla_rejects_fail_as_one_config_error(xla_flags, reason, monkeypatch):
  # Put in XLA_FLAGS, they would end the process when JAX starts its backend.
  config = tiny.get_config()
  config.xla_flags = xla_flags
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=4')
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.use_xla_flags(config)
  assert str(error.value).startswith(f'config.xla_flags={xla_flags!r}: XLA rejects it ({reason})')
  assert os.environ['XLA_FLAGS'] == '--xla_force_host_platform_device_count=4'


def test_xla_flags_go_unchecked_with_a_warning_where_jaxlib_cannot_check_them(monkeypatch,
                                                                            caplog):
  config = tiny.get_config()
  config.xla_flags = '--xla_gpu_autotune_level=2'
  failed = subprocess.CompletedProcess([], 1, '',
                                      "ModuleNotFoundError: No module named 'jaxlib._jax'")
  monkeypatch.setattr(config_lib.subprocess, 'run', lambda *args, **kwargs: failed)
  monkeypatch.setattr(config_lib.xla_bridge, 'backends_are_initialized', lambda: False)
  monkeypatch.delenv('XLA_FLAGS', raising=False)
  config_lib.use_xla_flags(config)
  assert os.environ['XLA_FLAGS'] == '--xla_gpu_autotune_level=2'
  assert "config.xla_flags not checked: ModuleNotFoundError: No module named 'jaxlib._jax'" in (
      caplog.text)


def test_xla_flags_join_the_environments_which_keeps_its_own_values(monkeypatch, caplog):
  config = multi30k.get_config()
  config.xla_flags = '--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=2'
  monkeypatch.setattr(config_lib.xla_bridge, 'backends_are_initialized', lambda: False)
  monkeypatch.delenv('XLA_FLAGS', raising=False)
  config_lib.use_xla_flags(config)
  assert os.environ['XLA_FLAGS'] == config.xla_flags
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=4 '
                     '--xla_gpu_autotune_level=4')
  config_lib.use_xla_flags(config)
  assert os.environ['XLA_FLAGS'] == ('--xla_force_host_platform_device_count=4 '
                                     '--xla_gpu_autotune_level=4 '
                                     '--xla_gpu_enable_triton_gemm=false')
  # Once the backend runs, XLA no longer reads them: said, and the environment left alone.
  monkeypatch.setattr(config_lib.xla_bridge, 'backends_are_initialized', lambda: True)
  monkeypatch.setenv('XLA_FLAGS', '')
  config_lib.use_xla_flags(config)
  assert os.environ['XLA_FLAGS'] == ''
  assert 'config.xla_flags --xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=2 not ' \
      'applied' in caplog.text
