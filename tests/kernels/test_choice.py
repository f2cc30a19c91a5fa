"""Each machine's choice of implementations: a pure function of the config and the machine."""

import re

import pytest
from absl import logging

from configs import default, multi30k
from transformer import config as config_lib
from transformer.kernels import choice
from transformer.kernels.choice import Machine

H100 = Machine('gpu', 'NVIDIA H100 80GB HBM3', '9.0', 8)
CPU, TPU = Machine('cpu', 'cpu', '', 4), Machine('tpu', 'TPU v5 lite', '', 4)


@pytest.mark.parametrize('machine', [CPU, H100, TPU], ids=str)
def test_loss_projection_and_decode_batch_default_by_machine(machine):
  config = multi30k.get_config()
  assert (config.implementation.loss_chunk_tokens, config.implementation.decode_batch_tokens) == (
      0, 0)
  chosen = choice.choose(config, machine)
  on_cpu = machine.backend == 'cpu'
  assert chosen.loss_chunk == (256 if on_cpu else None)
  assert chosen.decode_batch_tokens == (1950 // 4 if on_cpu else 2**17)
  assert chosen.loss_reduction == ('online' if machine.backend == 'gpu' else 'separate')
  assert chosen.attention_projection == ('heads' if on_cpu else 'matrix')
  config.implementation.update(loss_chunk_tokens=512, decode_batch_tokens=4096,
                               loss_reduction='online', attention_projection='matrix')
  chosen = choice.choose(config, machine)
  assert (chosen.loss_chunk, chosen.decode_batch_tokens, chosen.loss_reduction,
          chosen.attention_projection) == (512, 4096, 'online', 'matrix')
  model = config_lib.model_config(config, chosen)
  assert (model.attention_projection, model.attention_implementation) == ('matrix', 'xla')
  plain = config_lib.model_config(config)  # without a machine: the plain forms
  assert (plain.attention_projection, plain.attention_implementation) == ('heads', 'xla')


@pytest.mark.parametrize('machine,runs', [
    (H100, True),
    (Machine('gpu', 'NVIDIA A100-SXM4-40GB', '8.0'), True),
    (Machine('gpu', 'NVIDIA RTX PRO 6000', '12.0'), True),
    (Machine('gpu', 'Tesla T4', '7.5'), False),
    (Machine('gpu', 'Tesla V100-SXM2-16GB', '7.0'), False),
    (Machine('gpu', 'AMD Instinct MI250X', 'gfx90a'), False),
    (Machine('gpu', 'a GPU without a capability'), False),
    (CPU, False), (TPU, False)], ids=str)
def test_the_fused_kernels_are_chosen_on_nvidia_gpus_from_ampere(machine, runs):
  assert machine.runs_fused_kernels is runs
  config = default.get_config()
  config.max_length = 128  # rows the Pallas attention takes
  assert choice.choose(config, machine).attention == ('pallas' if runs else 'xla')
  config.max_length = 256
  assert choice.choose(config, machine).attention == ('cudnn' if runs else 'xla')
  if runs:
    return
  config.implementation.attention = 'cudnn'
  needs = (r"config.implementation.attention='cudnn': .*an NVIDIA GPU of compute capability "
           rf'8.0 or later \(here: {re.escape(str(machine))}\)')
  with pytest.raises(config_lib.ConfigError, match=needs):
    choice.choose(config, machine)
  assert str(Machine('gpu', 'Tesla T4', '7.5')) == 'Tesla T4, compute capability 7.5'


@pytest.mark.parametrize('machine', [CPU, H100, TPU], ids=str)
def test_attention_implementation_by_machine(machine):
  on_gpu = machine.backend == 'gpu'
  base, small = default.get_config(), multi30k.get_config()  # bfloat16, float32
  attention = lambda config: choice.choose(config, machine).attention
  assert attention(base) == ('cudnn' if on_gpu else 'xla')
  assert attention(small) == 'xla'
  base.max_length = 128  # rows the Pallas kernels take
  assert attention(base) == ('pallas' if on_gpu else 'xla')
  base.model.d_model = 768  # heads of 96: cuDNN's, not a power of 2
  assert attention(base) == ('cudnn' if on_gpu else 'xla')
  base.model.d_model = 512
  base.implementation.attention = 'xla'
  assert attention(base) == 'xla'
  base.implementation.attention = ''
  base.model.attention_dropout_rate = 0.1
  assert attention(base) == 'xla'
  small.implementation.attention = 'cudnn'
  with pytest.raises(config_lib.ConfigError, match=r"implementation.attention='cudnn'.*"
                     r"float32.*use 'xla'"):
    attention(small)


@pytest.mark.parametrize('change,wrong', [
    ({}, None), ({'model.dtype': 'float32'}, 'float32'), ({'max_length': 256}, 'now 256'),
    ({'model.attention_dropout_rate': 0.1}, 'now 0.1'), ({'model.d_model': 768}, 'now 96'),
    ({'model.num_heads': 64}, 'now 8')])
def test_the_fused_attention_is_chosen_only_where_its_kernels_run(change, wrong):
  config = default.get_config()
  config.update(max_length=128)  # the default's 256 is longer than the kernels' rows
  config.implementation.attention = 'pallas'
  for key, value in change.items():
    node, leaf = (config.model, key[6:]) if key.startswith('model.') else (config, key)
    node[leaf] = value
  if wrong is None:
    assert choice.choose(config, H100).attention == 'pallas'
  else:
    with pytest.raises(config_lib.ConfigError,
                       match=rf"implementation.attention='pallas'.*{wrong}.*use 'xla'"):
      choice.choose(config, H100)
  with pytest.raises(config_lib.ConfigError, match=r'\(here: cpu\)'):
    choice.choose(config, CPU)


@pytest.mark.parametrize('machine', [CPU, H100], ids=str)
def test_a_stored_run_keeps_only_the_implementations_this_machine_runs(monkeypatch, machine):
  monkeypatch.setattr(Machine, 'here', classmethod(lambda cls: machine))
  stored = default.get_config()
  stored.update(max_length=128)
  stored.implementation.attention = 'pallas'
  here = choice.runnable_here(stored)
  kept = machine.backend == 'gpu'
  assert here.implementation.attention == ('pallas' if kept else '')
  assert choice.for_this_machine(here).attention == ('pallas' if kept else 'xla')
  assert stored.implementation.attention == 'pallas'  # the stored config is unchanged
  unchanged = {'implementation': None}
  assert here.to_dict() | unchanged == stored.to_dict() | unchanged


def test_this_machines_choice_is_logged_once(monkeypatch):
  messages = []
  monkeypatch.setattr(logging, 'info', lambda message, *args: messages.append(message % args))
  monkeypatch.setattr(choice, '_logged', set())
  config = multi30k.get_config()
  for _ in range(3):
    assert choice.for_this_machine(config) == choice.choose(config, Machine.here())
  assert len(messages) == 1 and messages[0].startswith('on cpu: Implementations(attention=')
