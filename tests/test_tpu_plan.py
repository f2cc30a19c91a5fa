"""tpu_plan.py: train.py's programs compiled for a Cloud TPU slice here, with libtpu and no TPU;
what they take of a chip's memory, or what to change; the WMT configs' plans quoted as measured."""

import ast
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from configs import default, tiny
from conftest import error_line, run_script
from transformer import tpu_plan
from transformer.data import batching, token_store
import test_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tpu_plan(tmp_path, *args) -> subprocess.CompletedProcess:
  """tpu_plan.py as a user runs it, on a machine of one CPU device (not the tests' four), its
  plan the one row of tmp_path/plan.json."""
  return subprocess.run([sys.executable, 'tpu_plan.py', *args, '--name=plan',
                         f'--results_dir={tmp_path}'], cwd=ROOT, capture_output=True, text=True,
                        timeout=900, env={**os.environ, 'XLA_FLAGS': ''})


def kernel_calls(plan: dict) -> list[str]:
  """The custom calls of a plan's compiled programs that are kernels or GPU libraries, not XLA's
  own operations (a Pallas kernel on a TPU is a 'tpu_custom_call')."""
  return [call for program in plan['programs'].values() if program['fits']
          for call in program['custom_calls']
          if re.search('tpu_custom_call|mosaic|triton|cudnn|cublas', call, re.I)]


@pytest.mark.slow
def test_tpu_plan_compiles_train_py_s_programs_for_a_slice_and_counts_the_state_by_hand(tmp_path):
  result = run_tpu_plan(tmp_path, '--config=configs/tiny.py', '--topology=v5e:2x2')
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / 'plan.json') as f:
    (label, plan), = json.load(f).items()
  assert label == '--config=configs/tiny.py --topology=v5e:2x2'
  config = tiny.get_config()
  assert (plan['chip'], plan['chips'], plan['devices'], plan['hosts']) == ('TPU v5 lite', 4, 4, 1)
  # Google's 16 GB a chip, of which libtpu lets a program take 15.75 GiB.
  assert (plan['hbm_chip'], plan['hbm_per_device']) == (16 * 10**9, 15.75 * 2**30)
  assert "attention='xla'" in plan['implementations']  # none of the GPU kernels on a TPU
  # Rows of 16 that hold the 256 real tokens of a device (1024 / 4) and their padding, at the mean
  # fill of packed rows of WMT-like pairs; evaluation batches are packed the same.
  (rows, length), = plan['train_shapes']
  assert length == 16 and 256 / (rows * length) == pytest.approx(0.84, abs=0.08)
  assert plan['lengths'] == tpu_plan.STAND_IN and plan['tokens_per_device'] == 256
  assert list(plan['programs']) == [f'train_step {rows}x16', f'eval_step {rows}x16',
                                    'beam_search 64x16']
  # XLA's own operations only: no kernel of ours (a Pallas one would be a 'tpu_custom_call', as
  # the next test shows), no GPU library.
  assert kernel_calls(plan) == []
  assert all(program['fits'] and program['compile_secs'] > 0 and program['flops'] > 0
             for program in plan['programs'].values())
  # float32 parameters; Adam's two moments of each, and two int32 step counts (Adam's and the
  # schedule's).
  parameters = test_model.expected_parameter_count(config.vocab_size, 32, 64, 2, 2)
  assert plan['parameters'] == parameters
  assert plan['state_bytes'] == {'params': 4 * parameters, 'opt_state': 2 * 4 * parameters + 8}
  # The train step's arguments: the state (with its int32 step) and the batch, of which a TPU
  # lays out each small array in (8, 128) tiles.
  arrays = 2 * (1 + 2 * config.packing)  # sources, targets (+ segment ids, positions)
  state = 12 * parameters + 12
  assert state + arrays * rows * 16 * 4 <= plan['programs'][f'train_step {rows}x16'][
      'arguments'] <= state + arrays * -(-rows // 8) * 8 * 128 * 4 + 3 * 512
  # XLA's count of the step's FLOPs is near the model FLOPs train.py logs.
  assert 1 <= plan['compiled_train_flops'] / plan['model_flops'] < 1.6


@pytest.mark.slow
def test_tpu_plan_says_what_to_change_where_a_config_does_not_fit(tmp_path):
  # The train step alone: the other programs fit at any batch.
  flags = ('--config=configs/tiny.py', '--topology=v5e:2x2', '--config.tokens_per_batch=8000000',
           '--programs=train')
  result = run_tpu_plan(tmp_path, *flags)
  assert result.returncode == 1, result.stderr[-3000:]
  line = result.stderr.strip().splitlines()[-1]
  assert re.fullmatch(r'tpu_plan.py: train_step \d+x16 does not fit v5e-4 \(v5e:2x2\): [\d.]+ '
                      r'GiB per device against [\d.]+ GiB; raise grad_accum_steps to \d+ \(or '
                      r'lower tokens_per_batch, or take more chips\)', line), line
  steps = int(re.search(r'grad_accum_steps to (\d+)', line)[1])
  again = run_tpu_plan(tmp_path, *flags, f'--config.grad_accum_steps={steps}')
  assert again.returncode == 0, again.stderr[-3000:]  # the advice is enough
  with open(tmp_path / 'plan.json') as f:
    programs = json.load(f)[' '.join((*flags, f'--config.grad_accum_steps={steps}'))]['programs']
  assert [name.split()[0] for name in programs] == ['gradients', 'accumulate', 'apply_gradients']
  assert error_line(run_tpu_plan(tmp_path, *flags[:-1], '--programs=train,decode')) == (
      'tpu_plan.py: --programs: decode unknown; name some of train,eval,beam_search')


@pytest.mark.slow
def test_tpu_plan_lays_slices_out_as_cloud_tpu_vms_have_them():
  """One JAX device per chip (v4's and v5p's two cores as one), hosts of 4 chips (8 for small
  v5e and v6e slices), and the memory libtpu lets a program take on each."""
  script = """if True:
      import json, os
      os.environ.update(JAX_PLATFORMS='cpu', ALLOW_MULTIPLE_LIBTPU_LOAD='1')
      import jax
      from jax.experimental import pallas
      from transformer import tpu_plan
      slices = {name: tpu_plan.slice_of(name) for name in (
          'v4:2x2x1', 'v4:2x2x4', 'v5p:2x2x2', 'v5e:2x4', 'v5e:4x4', 'v6e:2x4')}
      def double(x_ref, out_ref):
        out_ref[...] = 2 * x_ref[...]
      shape = jax.ShapeDtypeStruct((8, 128), 'float32')
      kernel = tpu_plan.compile_program(
          lambda x: pallas.pallas_call(double, out_shape=shape)(x),
          slices['v5e:2x4']['devices'], (), jax.ShapeDtypeStruct((8, 8, 128), 'float32'))
      print(json.dumps({'calls': kernel['custom_calls'], **{
          name: [len(s['devices']), s['chips'], s['hosts'], s['hbm'] / 2**30]
          for name, s in slices.items()}}))"""
  result = subprocess.run([sys.executable, '-c', script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads(result.stdout.strip().splitlines()[-1]) == {
      'v4:2x2x1': [4, 4, 1, 30.75], 'v4:2x2x4': [16, 16, 4, 30.75],
      'v5p:2x2x2': [8, 8, 2, pytest.approx(95.74)], 'v5e:2x4': [8, 8, 1, 15.75],
      'v5e:4x4': [16, 16, 4, 15.75], 'v6e:2x4': [8, 8, 1, 31.25],
      'calls': ['tpu_custom_call']}  # a Pallas kernel, as the plans would show one


@pytest.mark.slow
def test_tpu_plan_compiles_the_programs_of_a_slice_of_several_hosts_for_a_split_s_lengths(
    tmp_path):
  """v4-32: 16 chips on 4 hosts, each host running the program pmapped over all 16; the batches
  shaped for the lengths of a train split prepare.py stored."""
  prepared = run_script('prepare.py', '--config=configs/tiny.py',
                        f'--config.tfds_data_dir={tmp_path}')
  assert prepared.returncode == 0, prepared.stderr[-3000:]
  (store,) = [line.split(': ')[-1] for line in prepared.stdout.splitlines()
              if line.startswith('synthetic (train)')]
  result = run_tpu_plan(tmp_path, '--config=configs/tiny.py', '--topology=v4:2x2x4',
                        f'--lengths_from={store}')
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / 'plan.json') as f:
    (plan,) = json.load(f).values()
  assert (plan['chip'], plan['devices'], plan['hosts']) == ('TPU v4', 16, 4)
  assert plan['lengths'] == f'the lengths in {store}'
  lengths = tuple(np.load(os.path.join(store, f'{side}_lengths.npy'))
                  for side in ('source', 'target'))
  shapes = tpu_plan.batch_shapes(tiny.get_config(), 16, lengths)
  assert plan['train_shapes'] == [list(shapes['train'][0])]  # 64 tokens a device, and padding
  assert all(program['fits'] for program in plan['programs'].values())
  # A directory that is not a token store: one line, before anything is compiled.
  result = run_tpu_plan(tmp_path, '--config=configs/tiny.py', '--topology=v4:2x2x4',
                        f'--lengths_from={tmp_path}/absent')
  assert result.returncode == 1 and error_line(result).startswith(
      f'tpu_plan.py: --lengths_from={tmp_path}/absent: not a token store (')
  assert error_line(result).endswith("give the directory prepare.py names for the train split")


@pytest.mark.parametrize('packing, max_length, devices', [(False, 256, 8), (False, 64, 1),
                                                           (True, 64, 4)])
def test_tpu_plan_s_train_shapes_take_what_train_py_s_largest_batches_take(packing, max_length,
                                                                          devices):
  """For the same pairs, no batch of train.py's plan has more rows at max_length than the plan's
  longest shape, more [rows x length] slots than its shapes have, or more slots x length
  (attention's); and the plan's slots are within 1/3 of the fullest batch's."""
  config = default.get_config()
  config.update(max_length=max_length, packing=packing)
  lengths = tpu_plan.stand_in_lengths(100_000)
  shapes = tpu_plan.batch_shapes(config, devices, lengths)
  tokenized = token_store.Tokenized('lengths', *(
      token_store.Ragged(np.zeros(side.sum(), np.uint8), side) for side in lengths))
  shards = batching.split_shards(tokenized, config, range(devices), devices, packing)
  counts, rows = batching.plan_rows(batching.shard_table(shards), shapes['tokens'])
  built = [(r, length) for r, length, n in zip(rows, batching.bucket_lengths(max_length), counts)
           if n]
  assert max(r for r, length in built if length == max_length) <= shapes['train'][0][0]
  for cost in (lambda r, length: r * length, lambda r, length: r * length * length):
    assert max(cost(*shape) for shape in built) <= max(cost(*shape) for shape in shapes['train'])
  most = max(r * length for r, length in built)
  assert most <= max(r * length for r, length in shapes['train']) < 4 / 3 * most
  assert shapes['eval'][1] == max_length


def test_each_wmt_config_names_the_slices_it_was_compiled_for_with_their_figures():
  """benchmarks/results/tpu_plan.json's plans, each a line of its config's docstring and a cell
  of docs/cloud_tpu.md's table: the share of a device's memory the largest train program and beam
  search take. Every program compiled runs XLA's operations only."""
  with open(os.path.join(ROOT, 'benchmarks', 'results', 'tpu_plan.json')) as f:
    plans = json.load(f)
  with open(os.path.join(ROOT, 'docs', 'cloud_tpu.md')) as f:
    table = f.read().split('Check before you rent')[1].split('\n\n')[1]
  checked = set()
  for label, plan in plans.items():
    path, _, arg = re.search(r'--config=(\S+)', label)[1].partition(':')
    checked.add((path, arg))
    with open(os.path.join(ROOT, path)) as f:
      docstring = ast.get_docstring(ast.parse(f.read()))
    shares = {name: max(p['total'] for n, p in plan['programs'].items()
                        if n.split()[0] in names) /
              plan['hbm_per_device'] for name, names in (
                  ('train step', ('train_step', 'gradients', 'accumulate', 'apply_gradients')),
                  ('beam search', ('beam_search',)))}
    fits = all(p['fits'] for p in plan['programs'].values())
    line = (f'{arg + " on " if arg else ""}{tpu_plan.cloud_name(plan)}: '
            f'{"fits" if fits else "does not fit"}; train step {shares["train step"]:.0%}, '
            f'beam search {shares["beam search"]:.0%}')
    assert line in docstring, f'{path}: {line!r}'
    # docs/cloud_tpu.md's "check before you rent" row of the config: "v4-32 (4): 18%, 44%".
    (row,) = [row for row in table.splitlines() if row.startswith(f'| `{path}{":" * bool(arg)}'
                                                                   f'{arg}` |')]
    cell = (f'{tpu_plan.cloud_name(plan)} ({plan["hosts"]}): {shares["train step"]:.0%}, '
            f'{shares["beam search"]:.0%}')
    assert cell in row, (cell, row)
    # What the device runs is XLA's own operations: no kernel (no 'tpu_custom_call').
    assert kernel_calls(plan) == [], label
  assert {('configs/default.py', ''), ('configs/wmt14.py', 'big,en-de'),
          ('configs/wmt14.py', 'base,en-fr'), ('configs/wmt14.py', 'big,en-fr')} <= checked


def test_the_cloud_tpu_launch_is_a_slice_and_config_compiled_for_it():
  with open(os.path.join(ROOT, 'docs', 'cloud_tpu.md')) as f:
    launch = f.read().split('Start all workers at once')[1].split('```sh')[1].split('```')[0]
  with open(os.path.join(ROOT, 'benchmarks', 'results', 'tpu_plan.json')) as f:
    plans = json.load(f).values()
  name = re.search(r'--accelerator-type=(\S+)', launch)[1]
  config = re.search(r'train.py --config=(\S+)', launch)[1]
  (plan,) = [plan for plan in plans if tpu_plan.cloud_name(plan) == name and
             f'--config={config} --topology={plan["topology"]} ' in plan['command']]
  assert all(program['fits'] for program in plan['programs'].values())
  # Every host runs the command (--worker=all): as many processes as the plan compiled for.
  assert f'# a {name} slice: {plan["hosts"]} hosts' in launch and '--worker=all' in launch
