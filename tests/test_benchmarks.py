"""The benchmarks' own logic: the profiler's reading of XLA's optimized HLO, the reproduction's
results table, the rounds of timings, a variant's own XLA options, the generated WMT-sized corpus, the
start-up milestones."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from flax import traverse_util

from benchmarks import (decoding_speed, hlo, profile_step, reproduce_multi30k, start_up, vs_flax,
                        wmt_scale, workload)
from benchmarks.measure import round_robin, sustained_rate
from configs import multi30k, tiny
from transformer import decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hlo_operations_are_classed_by_what_they_compute():
  def step(a, b):
    return jnp.tanh(a @ b).sum(), jnp.exp(a).sum(), a.T * 2.0, a.T

  a = jnp.ones((64, 32))
  text = jax.jit(step).lower(a, a.T).compile().as_text()
  classes = hlo.hlo_classes(text)
  entry = text[text.index('ENTRY'):]
  executed = {name: kind for name, (kind, _) in classes.items() if f'%{name} = ' in entry}
  kinds = sorted(kind for kind in executed.values() if kind != 'other')
  # One matmul (the dot, whatever XLA fuses into it), one reduction (exp then sum), and the
  # transposes: a plain copy (layout) and one fused with a multiply (elementwise).
  assert kinds.count('matmul') == 1, executed
  assert 'reduction' in kinds and 'layout' in kinds and 'elementwise' in kinds, executed
  (matmul,) = [name for name, kind in executed.items() if kind == 'matmul']
  assert classes[matmul][1].endswith('dot_general')  # named by its dot, not its fusion's root


# An optimized GPU module, cut down: three split-K matmuls writing partial products
# f32[parts, m, n] (two Triton fusions and a cuBLAS call) and the sums of their parts, one writing
# the matmul's layout and two, of two parts each, its transpose ({0,1}).
GPU_HLO = """HloModule step

%gemm_fusion_dot.1_computation (p0: bf16[16,64], p1: bf16[64,16]) -> f32[8,16,16] {
  %p0 = bf16[16,64]{1,0} parameter(0)
  %p1 = bf16[64,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,16,16]{2,1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_reduce (param_0: f32[8,16,16]) -> f32[16,16] {
  %param_0 = f32[8,16,16]{2,1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %reduce.1 = f32[16,16]{1,0} reduce(%param_0, %zero), dimensions={0}
}

%fused_reduce.1 (param_0.1: f32[2,16,16]) -> f32[16,16] {
  %param_0.1 = f32[2,16,16]{2,1,0} parameter(0)
  %zero.1 = f32[] constant(0)
  %reduce.2 = f32[16,16]{0,1} reduce(%param_0.1, %zero.1), dimensions={0}
  ROOT %bitcast.1 = f32[16,16]{1,0} bitcast(%reduce.2)
}

ENTRY %main (a: bf16[16,64], b: bf16[64,16]) -> (f32[16,16], f32[16,16], f32[16,16]) {
  %a = bf16[16,64]{1,0} parameter(0)
  %b = bf16[64,16]{1,0} parameter(1)
  %gemm_fusion_dot.1 = f32[8,16,16]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %gemm_fusion_dot.2 = f32[2,16,16]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %input_reduce_fusion = f32[16,16]{1,0} fusion(%gemm_fusion_dot.1), kind=kInput, calls=%fused_reduce
  %input_reduce_fusion.1 = f32[16,16]{1,0} fusion(%gemm_fusion_dot.2), kind=kInput, calls=%fused_reduce.1
  %custom-call.1 = (f32[2,16,16]{2,1,0}, s8[64]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
  %get-tuple-element.1 = f32[2,16,16]{2,1,0} get-tuple-element(%custom-call.1), index=0
  %input_reduce_fusion.2 = f32[16,16]{1,0} fusion(%get-tuple-element.1), kind=kInput, calls=%fused_reduce.1
  ROOT %tuple = (f32[16,16]{1,0}, f32[16,16]{1,0}, f32[16,16]{1,0}) tuple(%input_reduce_fusion, %input_reduce_fusion.1, %input_reduce_fusion.2)
}
"""


# Two kernels that are not matmuls: one slicing two thirds out of its float32 operand through a
# convert to bfloat16 and a bitcast (as a step's matmuls take the packed parameters: XLA converts
# the whole array in the fused computation, but the kernel reads only the slices' elements), and
# one reading both of its operands whole.
SLICE_HLO = """HloModule slices

%fused_slice (param_0: f32[16,48]) -> (bf16[4,4,16], bf16[4,4,16]) {
  %param_0 = f32[16,48]{1,0} parameter(0)
  %convert.1 = bf16[16,48]{1,0} convert(%param_0)
  %bitcast.1 = bf16[4,4,48]{2,1,0} bitcast(%convert.1)
  %slice.1 = bf16[4,4,16]{2,1,0} slice(%bitcast.1), slice={[0:4], [0:4], [0:16]}
  %slice.2 = bf16[4,4,16]{2,1,0} slice(%bitcast.1), slice={[0:4], [0:4], [16:32]}
  ROOT %tuple.1 = (bf16[4,4,16]{2,1,0}, bf16[4,4,16]{2,1,0}) tuple(%slice.1, %slice.2)
}

%fused_add (param_0.1: f32[16,48], param_1: f32[16,48]) -> f32[16,48] {
  %param_0.1 = f32[16,48]{1,0} parameter(0)
  %param_1 = f32[16,48]{1,0} parameter(1)
  ROOT %add.1 = f32[16,48]{1,0} add(%param_0.1, %param_1)
}

ENTRY %main (a: f32[16,48]) -> ((bf16[4,4,16], bf16[4,4,16]), f32[16,48]) {
  %a = f32[16,48]{1,0} parameter(0)
  %loop_slice_fusion = (bf16[4,4,16]{2,1,0}, bf16[4,4,16]{2,1,0}) fusion(%a), kind=kLoop, calls=%fused_slice
  %loop_add_fusion = f32[16,48]{1,0} fusion(%a, %a), kind=kLoop, calls=%fused_add
  ROOT %tuple = ((bf16[4,4,16]{2,1,0}, bf16[4,4,16]{2,1,0}), f32[16,48]{1,0}) tuple(%loop_slice_fusion, %loop_add_fusion)
}
"""


# A matmul reading its weight as a slice of the packed bfloat16 parameters in place: cuBLAS's call
# in a fusion of its own (XLA's dynamic-slice fusion), after the kernel that converts them; then a
# Pallas kernel taking two words and, in two slots, the matmul's product.
SLICED_MATMUL_HLO = """HloModule sliced_matmul

%convert_computation (param_0: f32[64]) -> bf16[64] {
  %param_0 = f32[64]{0} parameter(0)
  ROOT %convert.1 = bf16[64]{0} convert(%param_0)
}

%dynamic-slice-fusion (p0: bf16[64], p1: bf16[16,4]) -> (bf16[16,8], s8[64]) {
  %p1 = bf16[16,4]{1,0} parameter(1)
  %p0 = bf16[64]{0} parameter(0)
  %slice.1 = bf16[32]{0} slice(%p0), slice={[16:48]}
  %bitcast.1 = bf16[4,8]{1,0} bitcast(%slice.1)
  ROOT %cublas-lt-matmul.1 = (bf16[16,8]{1,0}, s8[64]{0}) custom-call(%p1, %bitcast.1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/layer/dot_general"}
}

ENTRY %main (w: f32[64], x: bf16[16,4], k: u32[2]) -> (bf16[16,8], f32[16]) {
  %w = f32[64]{0} parameter(0)
  %x = bf16[16,4]{1,0} parameter(1)
  %k = u32[2]{0} parameter(2)
  %wrapped_convert = bf16[64]{0} fusion(%w), kind=kLoop, calls=%convert_computation
  %dynamic_slice_fusion = (bf16[16,8]{1,0}, s8[64]{0}) fusion(%wrapped_convert, %x), kind=kCustom, calls=%dynamic-slice-fusion
  %y = bf16[16,8]{1,0} get-tuple-element(%dynamic_slice_fusion), index=0
  ROOT %pallas_call.1 = (bf16[16,8]{1,0}, f32[16]{0}) custom-call(%k, %y, %y), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI
}
"""

def test_kernel_bytes_count_what_each_kernel_reads_and_writes():
  # The slices: 2 x 256 float32 elements read, 2 x 256 bfloat16 written; the add: 768 float32
  # written, 2 x 768 read.
  assert hlo.kernel_bytes(SLICE_HLO) == {'elementwise': 2 * 256 * (4 + 2) + 3 * 768 * 4}
  # The convert: 64 float32 elements read, 64 bfloat16 written; the matmul is left out. The
  # Pallas kernel reads its operands whole, the product passed twice (a slot each) once, and
  # writes its outputs whole: two words and 16x8 bfloat16 read, 16x8 bfloat16 and 16 float32
  # written.
  assert hlo.kernel_bytes(SLICED_MATMUL_HLO) == {'elementwise': 64 * 4 + 64 * 2,
                                                 'other': 2 * 4 + 2 * 16 * 8 * 2 + 16 * 4}
  # The split-K sums read 8 + 2 + 2 float32 16x16 parts and write three 16x16 sums; the matmuls
  # are left out.
  assert hlo.kernel_bytes(GPU_HLO) == {'reduction': (8 + 2 + 2 + 3) * 16 * 16 * 4}
  assert hlo.shape_bytes('(bf16[16,64]{1,0}, s8[64]{0}, pred[])') == 16 * 64 * 2 + 64 + 1


THUNK_SEQUENCE = """000: kCommandBuffer      [source       | next=003 (1) ]
    001: kCopy         [source        | sink         ] kCopy
    002: kCustomKernel [prev=001 (1)  | sink         ] loop_add_fusion
003: kWhile              [prev=000 (1) | next=005 (1) ]
  condition:
    004: kCustomKernel [source | sink] loop_compare_fusion
005: kDynamicSliceFusion [prev=003 (1) | next=000 (1) ]
000: kCommandBuffer      [prev=005 (1) | sink ]
    006: kCublasLtMatmul [source | sink]
"""


def test_a_gpu_plan_counts_its_kernels_launches_and_the_split_k_sums_that_transpose():
  assert hlo.kernels_by_class(GPU_HLO) == {'matmul': 3, 'reduction': 3}
  assert hlo.kernels_by_class(SLICED_MATMUL_HLO) == {'elementwise': 1, 'matmul': 1, 'other': 1}
  assert hlo.hlo_classes(SLICED_MATMUL_HLO)['dynamic_slice_fusion'] == (
      'matmul', 'jit(step)/layer/dot_general')
  assert hlo.split_k_sums(GPU_HLO) == [{'parts': 8, 'transposed': False},
                                       {'parts': 2, 'transposed': True},
                                       {'parts': 2, 'transposed': True}]
  # The host launches the CUDA graphs, and the thunks outside them one by one.
  assert hlo.launches(THUNK_SEQUENCE) == {'cuda_graphs': 2, 'alone': 2}
  assert hlo.launches('') == {'cuda_graphs': 0, 'alone': 0}


needs_cuda_plugin = pytest.mark.skipif(
    importlib.util.find_spec('jax_plugins') is None or
    not any(importlib.util.find_spec(f'jax_plugins.xla_cuda{version}') for version in (12, 13)),
    reason="jax's CUDA plugin is not installed (pip install -e '.[cuda12]' or '.[cuda13]')")


@needs_cuda_plugin
def test_the_train_step_compiles_for_an_h100_without_one(tmp_path):
  subprocess.run([sys.executable, '-m', 'benchmarks.gpu_plan', '--size=multi30k',
                  '--shape=16x16', '--variant=', '--variant=xla_flags=',
                  '--variant=model.dtype=bfloat16 implementation.attention=cudnn',
                  '--variant=model.dtype=bfloat16',  # an H100's choice: the fused attention's
                  '--flax_dir=', f'--output={tmp_path}'], check=True, cwd=ROOT)
  configured, defaults, half, attention = json.loads(
      (tmp_path / 'gpu_plan.json').read_text())['rows']
  assert configured['kernels']['matmul'] > 0 and defaults['kernels']['matmul'] > 0
  # The fused attention's kernels in place of cuDNN's, one each way per attention layer, over the
  # projections of an input made in one product: fewer matmuls, and no sums of their gradients.
  assert attention['kernels']['other'] == half['kernels']['other']
  assert attention['kernels']['matmul'] < half['kernels']['matmul']
  assert attention['kernels']['elementwise'] < half['kernels']['elementwise']
  # The configs turn Triton's matmuls off: cuBLAS's return whole weight gradients.
  assert configured['split_k_sums'] == 0
  # And the weights' slices are taken before their matmuls: the step is launched as one CUDA
  # graph, as it was before the parameters were packed.
  assert configured['launches'] == {'cuda_graphs': 1, 'alone': 0}


def _kernel(name: str, start: int, dur: int, op: str = 'command_buffer', tid: int = 1) -> dict:
  """A kernel on the GPU timeline of `_write_trace`, in a CUDA graph unless its hlo_op says
  otherwise."""
  return {'ph': 'X', 'pid': 1, 'tid': tid, 'name': name, 'ts': start, 'dur': dur,
          'args': {'hlo_op': op}}


def _write_trace(path, events: list[dict], gpu: bool = True) -> str:
  """Writes a gzipped trace of `events` with the names of their processes: a GPU's timeline
  (pid 1, left out for a CPU's trace) and the host's (pid 7)."""
  processes = [(1, '/device:GPU:0')] * gpu + [(7, '/host:CPU')]
  with gzip.open(path, 'wt') as f:
    json.dump({'traceEvents': [{'ph': 'M', 'pid': pid, 'name': 'process_name',
                                'args': {'name': name}} for pid, name in processes] + events}, f)
  return str(path)


def test_a_profile_sums_each_jax_op_over_the_layers_and_names_the_libraries_kernels(tmp_path):
  # Two steps of a GPU trace: one fusion per layer from the same jax op, its kernels named like
  # it ('.' as '_'); a cuBLAS and a cuDNN kernel in the CUDA graph, named by no operation; one
  # cuBLAS call outside it, named by its hlo_op; and the host's launch of an operation, which is
  # not counted.
  fusion = lambda index: (
      f'%fused_add.{index} (p.{index}: f32[8]) -> f32[8] {{\n'
      f'  %p.{index} = f32[8]{{0}} parameter(0)\n'
      f'  ROOT %add.{index} = f32[8]{{0}} add(%p.{index}, %p.{index})\n}}\n\n')
  entry = lambda index: (
      f'  %loop_add_fusion.{index} = f32[8]{{0}} fusion(%x), kind=kLoop, '
      f'calls=%fused_add.{index}, metadata={{op_name="jit(step)/layer_{index}/norm/add"}}\n')
  module = ('HloModule step\n\n' + fusion(0) + fusion(1) +
            'ENTRY %main (x: f32[8]) -> (f32[8], f32[8]) {\n  %x = f32[8]{0} parameter(0)\n' +
            entry(0) + entry(1) +
            '  %custom-call.3 = f32[8]{0} custom-call(%x), custom_call_target="__cublas$gemm", '
            'metadata={op_name="jit(step)/layer_0/dense/dot_general"}\n'
            '  ROOT %t = (f32[8]{0}, f32[8]{0}) tuple(%loop_add_fusion.0, %loop_add_fusion.1)\n}\n')
  steps = [[_kernel('loop_add_fusion_0', start, 10), _kernel('loop_add_fusion_1', start + 10, 20),
            _kernel('nvjet_sm90_tst_128x128', start + 30, 50),
            _kernel('cudnn_generated_fort_native_sdpa_sm90_flash_bprop', start + 80, 40),
            _kernel('sm90_xmma_gemm_bf16', start + 120, 60, op='custom-call.3'),
            {'ph': 'X', 'pid': 7, 'name': 'loop_add_fusion.0', 'ts': start, 'dur': 1000}]
           for start in (0, 1000)]
  path = _write_trace(tmp_path / 'trace.json.gz', steps[0] + steps[1])
  summary = profile_step.summary(path, module, steps=2, top=4, flops=1.0)
  assert [(t['op'], t['class'], t['operations']) for t in summary['top_ops']] == [
      ('jit(step)/layer_N/dense/dot_general', 'matmul', 1),
      ('a matmul library kernel', 'matmul', 1), ('a cuDNN kernel', 'unknown', 1),
      ('jit(step)/layer_N/norm/add', 'elementwise', 2)]
  assert [t['secs'] for t in summary['top_ops']] == pytest.approx([60e-6, 50e-6, 40e-6, 30e-6])
  assert summary['operation_secs'] == pytest.approx(180e-6)
  assert summary['top'][-1]['op'] == 'jit(step)/layer_1/norm/add'  # each operation on its own


def test_the_device_timeline_splits_busy_time_within_steps_from_idle_time_between_them(tmp_path):
  # Two steps on a GPU's timeline, 80 us apart: kernels at 0-10, 5-8 (on another stream, within
  # the first) and 12-20 us, then 100-110 and 110-130 us; a copy and a host event, which do not
  # count.
  events = [_kernel('k', 0, 10), _kernel('k', 5, 3, tid=2), _kernel('k', 12, 8),
            _kernel('k', 100, 10), _kernel('k', 110, 20),
            {'ph': 'X', 'pid': 7, 'name': 'launch', 'ts': 20, 'dur': 80},
            _kernel('MemcpyH2D', 50, 10, tid=3)]  # the next batch's upload
  path = _write_trace(tmp_path / 'trace.json.gz', events)
  assert profile_step.device_timeline(path, steps=2) == pytest.approx(
      {'busy_secs': 24e-6, 'span_secs': 25e-6, 'between_steps_secs': 80e-6})
  path = _write_trace(tmp_path / 'trace.json.gz', events, gpu=False)  # a CPU's trace
  assert profile_step.device_timeline(path, steps=2) is None


def multi30k_row(overrides=(), test=None, validation=None, **fields) -> dict:
  """A row of multi30k.json: en-de with `overrides`, scored on test and validation at the
  sacreBLEU given (None: not scored on it); other fields as given."""
  scores = {'bleu_paper': 1.0, 'sentences_per_sec': 1.0, 'checkpoint_steps': [10]}
  splits = {split: dict(scores, sacrebleu=bleu)
            for split, bleu in (('validation', validation), ('test', test)) if bleu is not None}
  return {'pair': 'en-de', 'overrides': list(overrides), 'steps': 10, 'train_minutes': 1.0,
          'splits': splits, 'commit': 'abc1234', 'machine': {'cores': 2, 'cpu': 'CPU'}, **fields}


def reproduce_flags(monkeypatch, **given):
  """Sets reproduce_multi30k.FLAGS to its flags' defaults, but those given."""
  defaults = dict(pair='en-de', label='recipe', workdir=None, override=[], splits=None,
                  rescore=None, average_last=None, beam_size=None, alpha=None, output=None)
  monkeypatch.setattr(reproduce_multi30k, 'FLAGS', types.SimpleNamespace(**defaults | given))


def test_runs_that_differ_only_in_their_seed_are_a_group_on_one_machine_the_recipe_first():
  gpu = {'cores': 16, 'cpu': 'CPU', 'accelerator': 'H100', 'devices': 1}
  rows = {'dropout 0.2': multi30k_row(['model.dropout_rate=0.2'], test=39.0),
          'recipe seed 2 run before it failed': multi30k_row(['seed=2'], test=10.0),
          'recipe': multi30k_row(test=40.0, validation=41.0),
          'dropout 0.2 seed 1': multi30k_row(['seed=1', 'model.dropout_rate=0.2'], test=38.0),
          'recipe seed 2': multi30k_row(['seed=2'], test=40.5, validation=42.0),
          'recipe seed 1, GPU': multi30k_row(['seed=1'], test=40.0, machine=gpu),
          'layers 3, validation only': multi30k_row(['model.num_encoder_layers=3'], validation=1.0),
          'layers 3 seed 1': multi30k_row(['model.num_encoder_layers=3', 'seed=1'], test=39.0)}
  # A seed run twice counts once, its latest row; the GPU's run stands apart from the CPU's, and a
  # run scored on validation only is no seed of its configuration.
  dropout = [rows['dropout 0.2'], rows['dropout 0.2 seed 1']]
  recipe = [rows['recipe seed 2'], rows['recipe']]
  assert reproduce_multi30k.seed_groups(rows) == [dropout, recipe]
  assert reproduce_multi30k.seed_groups(rows, min_seeds=1) == [
      dropout, recipe, [rows['recipe seed 1, GPU']], [rows['layers 3 seed 1']]]
  # The mean and range of a group, a group of one's value alone, '-' unless each row has it.
  assert reproduce_multi30k.over_seeds(recipe, 'test') == '40.25 (40.00-40.50)'
  assert reproduce_multi30k.over_seeds(recipe, 'validation') == '41.50 (41.00-42.00)'
  assert reproduce_multi30k.over_seeds([rows['layers 3 seed 1']], 'test') == '39.00'
  assert reproduce_multi30k.over_seeds(dropout, 'validation') == '-'
  # The recipe's group (its seed=N runs in it) first in the table.
  table = reproduce_multi30k.markdown(rows).splitlines()
  seeds = table.index('| pair | config overrides | seeds | test sacreBLEU | test lowercased BLEU | '
                      'validation sacreBLEU | training minutes | machine |')
  assert [line.split(' | ')[1:3] for line in table[seeds + 2:seeds + 4]] == [
      ['(the recipe)', '2, 0'], ['model.dropout_rate=0.2', '0, 1']]


def test_a_rescore_scores_its_rows_run_as_the_row_states_not_as_the_run_was_trained(
    monkeypatch, tmp_path):
  """Rescoring row LABEL with another decoding is a new row: LABEL's training and config, its
  overrides with the change (replacing one of the same key), decoded as today's config with those
  overrides says, not as the run's config.json says. Without a change, row LABEL itself is scored
  on the splits it lacks and keeps the commit it trained."""
  trained = {'alpha': 0.6}  # the run's config, an older recipe's, which a newer row keeps
  rows = {'old': multi30k_row(['seed=1'], config=trained),
          'old_avg3': multi30k_row(['average_last=3', 'alpha=0.6'])}
  with open(tmp_path / 'multi30k.json', 'w') as f:
    json.dump(rows, f)
  scores = dict(sacrebleu=1.0, bleu_paper=1.0, sentences_per_sec=1.0, checkpoint_steps=[10])
  calls = []

  def run(*args):
    calls.append(args)
    output_dir = next(a.split('=', 1)[1] for a in args if a.startswith('--output_dir='))
    os.makedirs(output_dir)
    with open(os.path.join(output_dir, 'scores.json'), 'w') as f:
      json.dump(scores, f)

  monkeypatch.setattr(reproduce_multi30k, 'run', run)
  monkeypatch.setattr(reproduce_multi30k, 'commit', lambda checkout: 'def5678')
  # Without --splits (None), another decoding is scored on the splits its row was (test only
  # where the row was, as that is tuning), and the row itself on those it lacks.
  for label, rescore, changes, splits, (split, *decoding) in [
      ('new_beam8', 'old', dict(beam_size=8), ['validation'], ('validation', 5, 8, 1.0)),
      ('new_alpha1', 'old_avg3', dict(alpha=1.0), ['validation'], ('validation', 3, 4, 1.0)),
      ('recipe', 'old', {}, ['test'], ('test', 5, 4, 1.0)),
      ('old_avg10', 'old', dict(average_last=10), None, ('test', 10, 4, 1.0)),
      ('new_beam8_alpha06', 'new_beam8', dict(alpha=0.6), None, ('validation', 5, 8, 0.6)),
      ('new_beam8', 'new_beam8', {}, None, ('test', 5, 8, 1.0))]:
    workdir = tmp_path / rescore
    reproduce_flags(monkeypatch, label=label, rescore=rescore, splits=splits,
                    output=str(tmp_path), workdir=str(workdir), **changes)
    reproduce_multi30k.main([])
    assert calls == [('eval.py', f'--workdir={workdir}', f'--split={split}',
                      f'--output_dir={workdir / f"eval_{label if changes else rescore}_{split}"}',
                      *(f'--{n}={v}' for n, v in zip(reproduce_multi30k.DECODING, decoding)))]
    calls.clear()
  with open(tmp_path / 'multi30k.json') as f:
    written = json.load(f)
  assert list(written) == [
      'old', 'old_avg3', 'new_beam8', 'new_alpha1', 'old_avg10', 'new_beam8_alpha06']
  assert written['old'] == dict(rows['old'], splits={'test': scores})
  assert written['new_beam8'] == dict(
      rows['old'], overrides=['seed=1', 'beam_size=8'], commit='def5678',
      splits={'validation': scores, 'test': scores})
  assert written['new_alpha1'] == dict(rows['old_avg3'], overrides=['average_last=3', 'alpha=1.0'],
                                       commit='def5678', splits={'validation': scores})
  assert written['new_beam8_alpha06']['overrides'] == ['seed=1', 'beam_size=8', 'alpha=0.6']
  empty_splits = (r'--rescore=x: --splits is empty: name the splits to score '
                  r'\(validation, test\), or leave it out')
  for given, error in [
      (dict(rescore='recipe'), r'--rescore=recipe: no such row in multi30k.json \(rows: old, '),
      (dict(rescore='new_beam8'), 'new_beam8: already scored on validation, test; give --splits'),
      (dict(rescore='old', splits=['validation', 'test']), 'old: already scored on test; give'),
      (dict(rescore='x', splits=[]), empty_splits),  # no split to score, a change given or not
      (dict(rescore='x', splits=[], beam_size=6), empty_splits),
      (dict(beam_size=8), 'a new run takes them as --override=key=value')]:
    reproduce_flags(monkeypatch, output=str(tmp_path), **given)
    with pytest.raises(SystemExit, match=error):
      reproduce_multi30k.main([])


def test_every_multi30k_row_states_how_its_run_trained_and_was_scored_and_is_in_the_table():
  """Each row of benchmarks/results/multi30k.json: its steps, and its scores' beam, length penalty
  and checkpoints averaged are those of today's config with its overrides, and so is its run's
  config.json where the row keeps it; multi30k.md is the table of these rows."""
  path = os.path.join(ROOT, 'benchmarks', 'results', 'multi30k')
  with open(f'{path}.json', encoding='utf-8') as f:
    rows = json.load(f)
  for label, row in rows.items():
    stated = reproduce_multi30k.stated_config(row)
    assert row['steps'] == stated['num_train_steps'], label
    for split, scores in row['splits'].items():
      assert (scores['beam_size'], scores['alpha'], len(scores['checkpoint_steps'])) == (
          stated['beam_size'], stated['alpha'], stated['average_last']), (label, split)
  assert any('config' in row for row in rows.values()), 'no row of multi30k.json keeps its config'
  unstated = {label: reproduce_multi30k.unstated_training(row) for label, row in rows.items()}
  assert {label: keys for label, keys in unstated.items() if keys} == {}
  with open(f'{path}.md', encoding='utf-8') as f:
    assert reproduce_multi30k.markdown(rows) == f.read()


def test_a_recipe_changed_without_its_older_rows_overrides_shows_in_them():
  """A run of an en-de recipe of before, at another learning rate than today's: without an
  `lr_scale` override its row states today's rate, and so does the row rescoring it with beam 8;
  with the override, nothing differs."""
  today = multi30k.get_config('en-de')
  before = json.loads(today.to_json()) | {'lr_scale': today.lr_scale / 2, 'seed': 1}
  row = {'pair': 'en-de', 'overrides': ['seed=1'], 'config': before}
  assert reproduce_multi30k.unstated_training(row) == {
      'lr_scale': (today.lr_scale / 2, today.lr_scale)}
  rescored = reproduce_multi30k.rescored_row(row, {'beam_size': 8})
  assert reproduce_multi30k.unstated_training(rescored) == reproduce_multi30k.unstated_training(row)
  row['overrides'].insert(0, f'lr_scale={today.lr_scale / 2}')
  assert reproduce_multi30k.unstated_training(row) == {}
  del row['config']
  assert reproduce_multi30k.unstated_training(row) == {}  # a row written before rows kept one


def test_a_row_states_its_overrides_each_as_its_keys_type(monkeypatch, tmp_path):
  row = {'pair': 'en-fr', 'overrides': ['lr_scale=1.4', 'model.share_embeddings=False',
                                        'model.d_ff=1024', 'target_vocab_size=10240']}
  today = traverse_util.flatten_dict(multi30k.get_config('en-fr').to_dict(), sep='.')
  assert reproduce_multi30k.stated_config(row) == today | {  # target_vocab_size: a removed key
      'lr_scale': 1.4, 'model.share_embeddings': False, 'model.d_ff': 1024}
  with pytest.raises(flags.IllegalFlagValueError,
                     match='--config.packing=yes: .*Non-boolean argument to boolean flag'):
    reproduce_multi30k.stated_config(dict(row, overrides=['packing=yes']))

  def run(script, config_flag, workdir_flag, manual_dir_flag, *overrides):
    """train.py's config.json, without the training."""
    workdir = workdir_flag.split('=', 1)[1]
    os.makedirs(workdir)
    config = multi30k.get_config(config_flag.split(':')[1])
    config.manual_dir = manual_dir_flag.split('=', 1)[1]
    config.update_from_flattened_dict(
        {key: int(value) for key, value in (o[len('--config.'):].split('=') for o in overrides)})
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json())

  monkeypatch.setattr(reproduce_multi30k, 'run', run)
  monkeypatch.setattr(reproduce_multi30k, 'MANUAL_DIR', types.SimpleNamespace(value='/multi30k'))
  reproduce_flags(monkeypatch, label='x', workdir=str(tmp_path / 'x'), pair='en-fr',
                  override=['num_train_steps=7'])
  workdir, new_row = reproduce_multi30k.train()
  assert (workdir, new_row['steps'], new_row['overrides']) == (
      str(tmp_path / 'x'), 7, ['num_train_steps=7'])
  # The row keeps the run's config but for the data's path on the machine it ran on.
  assert traverse_util.flatten_dict(new_row['config'], sep='.') == {
      key: value for key, value in reproduce_multi30k.stated_config(new_row).items()
      if key != 'manual_dir'}


def test_a_reproduction_row_names_the_commit_it_trained(monkeypatch, tmp_path):
  head = ['1111111']

  def train():
    head[0] = '2222222'  # a commit made while train.py runs
    return str(tmp_path), {'pair': 'en-de', 'overrides': ['seed=1'], 'steps': 10,
                           'train_minutes': 1.0}

  monkeypatch.setattr(reproduce_multi30k, 'commit', lambda checkout: head[0])
  monkeypatch.setattr(reproduce_multi30k, 'train', train)
  reproduce_flags(monkeypatch, label='seed_1', splits=[], output=str(tmp_path))
  reproduce_multi30k.main([])
  with open(tmp_path / 'multi30k.json') as f:
    assert json.load(f)['seed_1']['commit'] == '1111111'


def test_flax_examples_that_cannot_be_fetched_say_in_one_line_where_they_go(monkeypatch,
                                                                          tmp_path):
  pip = subprocess.CompletedProcess([], 1, '', 'Looking in links: /tmp\nERROR: No matching '
                                    f'distribution found for flax=={flax.__version__}\n')
  monkeypatch.setattr(workload.subprocess, 'run', lambda *args, **kwargs: pip)
  with pytest.raises(SystemExit) as raised:
    workload.fetch_flax_examples(f'{tmp_path}/flax')
  assert str(raised.value) == (
      f'the flax {flax.__version__} sdist, whose examples/wmt is the reference, could not be '
      f'fetched (pip download: ERROR: No matching distribution found for flax=={flax.__version__})'
      f'; put its examples/wmt/ models.py, decode.py, train.py, bleu.py in {tmp_path}/flax '
      '(--flax_dir), or run where PyPI is reachable')
  assert os.listdir(tmp_path) == []


@pytest.fixture(scope='module')
def flax_examples():
  """flax examples/wmt of the installed flax, fetched from PyPI's sdist once per machine."""
  return workload.fetch_flax_examples(workload.FLAX_DIR)


@pytest.mark.slow
def test_vs_flax_compares_like_for_like_and_names_what_differs_as_shipped(flax_examples):
  config = tiny.get_config()
  model = config.model
  batch = workload.random_batch(np.random.default_rng(0), 2, 8, config.vocab_size)
  like = workload.Ours(workload.like_flax(config))
  assert workload.differences(like, workload.Flax(flax_examples, like), batch) == {}

  shipped = workload.Ours(config)
  unlike = workload.differences(shipped, workload.Flax(flax_examples, shipped), batch)
  ours_count, flax_count = unlike.pop('parameters')
  assert flax_count - ours_count == 2 * 2 * model.d_model  # flax's stacks end in a LayerNorm
  ours_sites, flax_sites = unlike.pop('dropout sites')
  # flax's MlpBlock also drops out its hidden layer, in every layer of both stacks.
  layers = model.num_encoder_layers + model.num_decoder_layers
  assert flax_sites == {**ours_sites, f'2x8x{model.d_ff} at 0.1': layers}
  assert unlike == {}

  # A bfloat16 model's output projection: flax's multiplies in float32, ours unless told so in
  # bfloat16 (float32 sums).
  half = workload.like_flax(config)
  half.model.dtype = 'bfloat16'
  ours = workload.Ours(half)
  assert workload.differences(ours, workload.Flax(flax_examples, ours), batch) == {}
  half.model.output_projection_dtype = ''
  ours = workload.Ours(half)
  assert workload.differences(ours, workload.Flax(flax_examples, ours), batch) == {
      'output projection operand dtypes': (['bfloat16 x bfloat16'], ['float32 x float32'])}


@pytest.mark.slow
def test_each_side_compiles_its_train_step_with_its_own_xla_options(flax_examples):
  batch = workload.random_batch(np.random.default_rng(0), 4, 8, 320)
  sharded = jax.tree_util.tree_map(lambda x: np.stack([x] * jax.local_device_count()), batch)

  def ours(xla_flags):
    config = tiny.get_config()
    config.xla_flags = xla_flags
    return workload.Ours(config)

  # XLA's booleans take Python's, its integers strings; XLA rejects a value it cannot read only
  # when the option reaches the compilation.
  gpu_flags = ours('--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0')
  assert gpu_flags.compiler_options == {'xla_gpu_enable_triton_gemm': False,
                                        'xla_gpu_autotune_level': '0'}
  gpu_flags.train(sharded)
  with pytest.raises(Exception, match='xla_gpu_autotune_level'):
    ours('--xla_gpu_autotune_level=high').train(sharded)
  # Programs in one process, each with its own options: XLA_FLAGS would give them all the same.
  loop_fusions = lambda side: side.train_hlo(sharded).count('kind=kLoop, calls=%fused_computation')
  flax_side = lambda options=None: workload.Flax(flax_examples, gpu_flags, options)
  for fused, unfused in ((gpu_flags, ours('--xla_disable_hlo_passes=fusion')),
                         (flax_side(), flax_side({'xla_disable_hlo_passes': 'fusion'}))):
    assert loop_fusions(fused) > 10 and loop_fusions(unfused) == 0
    unfused.train(sharded, 2)  # and runs that program


def test_a_packed_random_batch_is_laid_out_as_train_pys_packed_batches():
  batch = workload.packed_batch(np.random.default_rng(0), 12, 64, 320, pair_lengths=(5, 30))
  assert all(x.shape == (12, 64) and x.dtype == np.int32 for x in batch.values())
  # It reaches flax under the names its train_step reads (batch.get(k)).
  flax_names = {
      'sources': 'inputs', 'targets': 'targets', 'source_segment_ids': 'inputs_segmentation',
      'source_positions': 'inputs_position', 'target_segment_ids': 'targets_segmentation',
      'target_positions': 'targets_position'}
  inputs = workload.Flax.inputs(batch)
  assert len(inputs) == len(batch) == 6
  assert all(inputs[flax_names[name]] is x for name, x in batch.items())
  for side in ('source', 'target'):
    tokens, segments, positions = (batch[f'{side}s'], batch[f'{side}_segment_ids'],
                                   batch[f'{side}_positions'])
    assert ((tokens > 0) == (segments > 0)).all()  # real tokens and only they have a segment
    assert (tokens < 320).all()
    for row in range(12):
      real = segments[row] > 0
      assert real[:real.sum()].all()  # the pairs first, then padding
      ids = segments[row][real]
      # Segments 1, 2, ... back to back, each 5-30 long, counted from position 0, ending in EOS.
      bounds = np.flatnonzero(np.diff(ids, append=0))
      assert (ids[bounds] == np.arange(1, len(bounds) + 1)).all()
      lengths = np.diff(bounds, prepend=-1)
      assert ((lengths >= 5) & (lengths <= 30)).all()
      assert (positions[row][real] == np.concatenate([np.arange(n) for n in lengths])).all()
      assert (tokens[row][bounds] == decode.EOS_ID).all()
      assert (tokens[row][real][np.setdiff1d(np.arange(real.sum()), bounds)] != decode.EOS_ID).all()
    assert (segments > 0).mean() > 0.85  # packed: rows nearly full
  assert (batch['source_segment_ids'].max(1) == batch['target_segment_ids'].max(1)).all()


def test_a_variant_quotes_a_value_with_spaces_as_a_shell_does():
  config = workload.load_config(
      "xla_flags='--xla_gpu_enable_triton_gemm=false --xla_disable_hlo_passes=dot-merger' "
      'implementation.attention_projection=heads model.num_heads=4', size='base')
  assert config.xla_flags == ('--xla_gpu_enable_triton_gemm=false '
                              '--xla_disable_hlo_passes=dot-merger')
  assert (config.implementation.attention_projection == 'heads' and
          config.model.num_heads == 4)
  with pytest.raises(SystemExit, match='model.num_head'):
    workload.load_config('model.num_head=4')


def test_the_sustained_rate_is_timed_after_the_warm_up_in_batches_waited_for_once():
  # A simulated GPU: a call takes 2 ms for its first 0.5 s of work (clocks still low), then 1 ms;
  # each wait costs 0.1 ms more.
  now = [0.0]

  class Result:
    def block_until_ready(self):
      now[0] += 1e-4

  def call():
    now[0] += 2e-3 if now[0] < 0.5 else 1e-3
    return Result()

  warm = sustained_rate(call, repeats=3, warmup_secs=1.0, clock=lambda: now[0])
  # 32 calls a batch (the first batch of at least 50 ms), one wait each: 32 / 32.1 ms.
  assert warm == pytest.approx(32 / 0.0321)
  now[0] = 0.0
  assert sustained_rate(call, repeats=3, warmup_secs=0.0,
                        clock=lambda: now[0]) == pytest.approx(32 / 0.0641)


def test_round_robin_rotates_the_order_every_round():
  order = []
  times = round_robin({name: lambda name=name: order.append(name) for name in 'abc'}, 4)
  assert ''.join(order) == 'abc' 'bca' 'cab' 'abc'
  assert all(len(secs) == 4 for secs in times.values())


@pytest.mark.slow
def test_the_wmt_sized_corpus_is_aligned_with_wmt_like_lengths(tmp_path):
  wmt_scale.generate(str(tmp_path), pairs=3000)
  read = lambda name: gzip.open(tmp_path / name, 'rt', encoding='utf-8').read().splitlines()
  for split, size in (('train', 3000), ('validation', 3000), ('test', 3000)):
    english, german = read(f'{split}.en.gz'), read(f'{split}.de.gz')
    assert len(english) == len(german) == size
    assert [len(s.split()) for s in english] == [len(s.split()) for s in german]
    assert english != german
  words = [len(s.split()) for s in read('train.en.gz')]
  assert 17 <= sorted(words)[len(words) // 2] <= 23 and 1 <= min(words) and max(words) <= 150
  before = (tmp_path / 'train.en.gz').stat().st_mtime_ns
  wmt_scale.generate(str(tmp_path), pairs=3000)  # there already: left as it is
  assert (tmp_path / 'train.en.gz').stat().st_mtime_ns == before


@pytest.mark.parametrize('script, results, quoted_in', [
    (wmt_scale, 'benchmarks/results/wmt_scale', None),
    (start_up, 'benchmarks/results/start_up', None),
    (vs_flax, 'benchmarks/results/vs_flax', None),
    (vs_flax, 'benchmarks/results/vs_flax_base_cpu', None),
    (profile_step, 'benchmarks/results/profile_step_multi30k', None),
    (decoding_speed, 'docs/decoding_speed', 'docs/decoding.md')])
def test_a_results_table_is_its_scripts_markdown_of_its_json(script, results, quoted_in):
  with open(os.path.join(ROOT, f'{results}.json'), encoding='utf-8') as f:
    table = script.markdown(json.load(f))
  with open(os.path.join(ROOT, f'{results}.md'), encoding='utf-8') as f:
    assert f.read() == table
  if quoted_in:  # its rows under their header
    with open(os.path.join(ROOT, quoted_in), encoding='utf-8') as f:
      assert '\n'.join(table.splitlines()[4:]) in f.read()


def test_the_wmt_sized_corpus_meets_its_goals():
  """A resume reaches its first step within 60 s, a first start within 15 minutes, in at most
  8 GiB, with the token ids stored in about 2 bytes each."""
  with open(os.path.join(ROOT, 'benchmarks', 'results', 'wmt_scale.json'), encoding='utf-8') as f:
    measured = json.load(f)
  assert measured['pairs'] == 4_500_000 and measured['resume']['first_step'] <= 60
  assert measured['first_start']['first_step'] <= 15 * 60
  assert max(run['peak_memory_gib'] for run in (measured['prepare'], measured['first_start'],
                                                 measured['resume'])) <= 8
  assert measured['stored']['bytes'] < 2.2 * sum(measured['stored']['tokens'])


@pytest.mark.slow
def test_start_up_notes_each_milestone_and_stops_train_py_in_its_closing_bleu(tmp_path):
  workdir = tmp_path / 'run'
  subprocess.run([sys.executable, '-m', 'benchmarks.start_up', '--config=configs/tiny.py',
                  '--steps=40', f'--workdir={workdir}', f'--output={tmp_path}', '--label=tiny',
                  '--parts'], cwd=ROOT, check=True, capture_output=True)
  with open(tmp_path / 'start_up.json') as f:
    row = json.load(f)['tiny']
  milestones = row['milestones']
  assert list(milestones) == ['first_log_line', 'first_training_row', 'last_checkpoint',
                              'sigterm_to_exit']
  assert 0 < milestones['first_log_line'] < milestones['first_training_row'] <= milestones[
      'last_checkpoint']
  assert milestones['sigterm_to_exit'] < 5  # the closing BLEU ends at once
  assert row['overrides'] == ['num_train_steps=40'] and not row['fresh_data']
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['40']  # the last; then stopped
  log = (workdir / 'train.log').read_text()
  assert ('SIGTERM: stopped in the closing BLEU: every checkpoint is saved, the last at step 40'
          in log)
  assert 'sacreBLEU' not in log  # stopped before a score
  # Before the first log line, in a fresh interpreter: importing train.py's modules (jax, flax,
  # TFDS, ...) takes a good part of a second at least.
  parts = row['parts']
  assert list(parts) == ['interpreter', 'imports', 'cluster_lookup', 'backend']
  assert parts['imports'] > 0.2 and all(secs >= 0 for secs in parts.values())
  table = (tmp_path / 'start_up.md').read_text()
  assert '| tiny |' in table and ' + '.join(map(str, parts.values())) in table


def test_the_readmes_interop_table_is_the_benchmarks_row():
  """The README's "Share and serve" table: the figures of benchmarks/results/interop_speed.json,
  where CTranslate2's int8 model scores within half a BLEU of ours."""
  with open(os.path.join(ROOT, 'benchmarks', 'results', 'interop_speed.json'),
            encoding='utf-8') as f:
    row = json.load(f)['Multi30k recipe, seed 0']
  scores = {name: engine['sacrebleu'] for name, engine in row['engines'].items()}
  assert scores['ours'] > 35 and abs(scores['ctranslate2 int8'] - scores['ours']) <= 0.5, scores
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    readme = f.read()
  for name, engine in row['engines'].items():
    assert (f'| {name} | {engine["sentences_per_sec"]:.1f} | {engine["sacrebleu"]:.2f} | '
            f'{engine["identical_to_ours"] / 10:.1f}% / '
            f'{engine["identical_to_ours_alpha_0"] / 10:.1f}% |') in readme, name


@pytest.mark.slow
def test_decoding_speed_times_every_way_in_rounds_on_the_same_sentences(tiny_run):
  sentences = ['ab cd', 'ef gh ab', 'cd']
  seconds = decoding_speed.measure_ways(tiny_run, sentences, beam_size=2, repeats=2)
  assert list(seconds) == list(decoding_speed.ways(2)) and set(decoding_speed.GOALS) < set(seconds)
  assert all(len(rounds) == 2 and min(rounds) > 0 for rounds in seconds.values())
  row = {'machine': {'cores': 2, 'cpu': 'CPU'}, 'workdir': 'W', 'sentences': 3, 'beam_size': 2,
         'sentences_per_sec': {'beam search': 10.0, 'nbest': 9.5, 'greedy': 30.0}}
  assert decoding_speed.markdown({'label': row}).splitlines()[-3:] == [
      '| label | 2 cores, CPU | W, 3, 2 | beam search | 10.0 | 1.00 |',
      '| label | 2 cores, CPU | W, 3, 2 | nbest | 9.5 | 0.95 (0.90) |',
      '| label | 2 cores, CPU | W, 3, 2 | greedy | 30.0 | 3.00 |']
