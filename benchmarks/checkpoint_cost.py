r"""What a checkpoint save costs a training loop dispatching its steps from Python, as on a GPU.

  python -m benchmarks.checkpoint_cost [--config=configs/multi30k.py] [--baseline=REV]
      [--rounds=3] [--saves=10] [--label=NAME]

On an H100 the Multi30k recipe's step takes ~3 ms, its loop saves every 100 steps, and each save
cost the loop ~0.28 s (docs/speed.md). Here a loop of 3 ms slices of Python work stands for the
steps and saves the config's initial state every 100 slices through
`transformer.checkpoints.Checkpoints`, at train.py's switch interval on GPUs. Per save it notes
the loop's seconds beyond those of the same slices without saves, and a save's own seconds (its
call and its wait, with nothing beside it). With --baseline, the `Checkpoints` of another commit
(its transformer/checkpoints.py, run with this checkout's other modules) is timed in the same
process, alternating rounds with this checkout's.

Adds a row under --label to benchmarks/results/checkpoint_cost.{json,md}.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from benchmarks.measure import add_row, commit, machine, machine_name
from transformer import checkpoints
from transformer import config as config_lib
from transformer import train_step

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_SECS = 3e-3  # the Multi30k recipe's step on an H100
STEPS_PER_SAVE = 100  # its checkpoint_every_steps
SWITCH_INTERVAL = 5e-4  # train.py's on GPUs


def steps(count: int):
  """`count` slices of STEP_SECS of Python work, holding the interpreter as a dispatching loop."""
  for _ in range(count):
    began = time.perf_counter()
    while time.perf_counter() - began < STEP_SECS:
      pass


def module_at(rev: str):
  """transformer/checkpoints.py as of commit `rev`, imported as a module of its own."""
  source = subprocess.run(['git', 'show', f'{rev}:transformer/checkpoints.py'], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout
  path = os.path.join(tempfile.mkdtemp(), f'checkpoints_{rev}.py')
  with open(path, 'w') as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location(f'checkpoints_{rev}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def loop_secs_per_save(module, state, saves: int, steps_per_save: int = STEPS_PER_SAVE) -> float:
  """Seconds the loop loses per save, against the same steps without saves just before (the
  fastest of 3 runs: a run the machine interrupted would hide part of the saves' cost)."""
  store = module.Checkpoints(tempfile.mkdtemp(), keep=10)
  store.save(0, state, {'step': 0})  # Orbax's first save sets up what later ones reuse
  store.wait()
  alone = float('inf')
  for _ in range(3):
    began = time.perf_counter()
    steps(saves * steps_per_save)
    alone = min(alone, time.perf_counter() - began)
  began = time.perf_counter()
  for save in range(1, saves + 1):
    steps(steps_per_save)
    store.save(save * steps_per_save, state, {'step': save})
  looped = time.perf_counter() - began
  store.close()
  return (looped - alone) / saves


def secs_per_save(module, state, saves: int) -> float:
  """A save's seconds from its call to the end of its wait, with nothing beside it (median)."""
  store = module.Checkpoints(tempfile.mkdtemp(), keep=10)
  secs = []
  for save in range(saves + 1):  # the first sets up what later ones reuse
    began = time.perf_counter()
    store.save(save, state, {'step': save})
    store.wait()
    secs.append(time.perf_counter() - began)
  store.close()
  return float(np.median(secs[1:]))


def main(argv):
  del argv
  config = FLAGS.config
  initial = train_step.initial_state(config, config_lib.model_config(config))
  state = jax.tree_util.tree_map(np.asarray, {'params': initial.params,
                                              'opt_state': initial.opt_state})
  leaves = jax.tree_util.tree_leaves(state)
  sides = {'this checkout': checkpoints}
  if FLAGS.baseline:
    sides[FLAGS.baseline] = module_at(FLAGS.baseline)
  sys.setswitchinterval(SWITCH_INTERVAL)
  loop, alone = {side: [] for side in sides}, {side: [] for side in sides}
  for _ in range(FLAGS.rounds):
    for side, module in sides.items():
      loop[side].append(loop_secs_per_save(module, state, FLAGS.saves))
      alone[side].append(secs_per_save(module, state, FLAGS.saves))
  measured = {side: {'loop_secs_per_save': float(np.median(loop[side])),
                     'loop_secs_per_save_rounds': loop[side],
                     'secs_per_save': float(np.median(alone[side])),
                     'secs_per_save_rounds': alone[side]} for side in sides}
  row = {'commit': commit(ROOT),
         'config': config_flags.get_config_filename(FLAGS['config']), 'arrays': len(leaves),
         'megabytes': sum(x.nbytes for x in leaves) / 1e6, 'rounds': FLAGS.rounds,
         'saves': FLAGS.saves, 'sides': measured, 'machine': machine()}

  def markdown(rows: dict) -> str:
    lines = [f'What a save costs a loop of {STEP_SECS * 1e3:.0f} ms Python steps saving every '
             f'{STEPS_PER_SAVE} steps at a {SWITCH_INTERVAL * 1e3} ms switch interval '
             '(`python -m benchmarks.checkpoint_cost`): the loop\'s milliseconds per save beyond '
             'the same steps without saves, and a save\'s own milliseconds (call and wait, '
             'nothing beside it). Medians of the rounds, [lowest, highest]; the sides of a row '
             'alternate in one process.', '',
             '| label | commit | config | state | Checkpoints of | loop ms per save | save ms '
             '| machine |', '| --- | --- | --- | --- | --- | --- | --- | --- |']
    for label, r in rows.items():
      for side, m in r['sides'].items():
        span = lambda key: (f"{m[key] * 1e3:.0f} [{min(m[key + '_rounds']) * 1e3:.0f}, "
                            f"{max(m[key + '_rounds']) * 1e3:.0f}]")
        lines.append(f"| {label} | {r['commit']} | {r['config']} | {r['arrays']} arrays, "
                     f"{r['megabytes']:.0f} MB | {side} | {span('loop_secs_per_save')} | "
                     f"{span('secs_per_save')} | {machine_name(r['machine'])} |")
    return '\n'.join(lines) + '\n'

  add_row(FLAGS.output, 'checkpoint_cost', FLAGS.label, row, markdown)


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', 'configs/multi30k.py', 'The experiment.')
  flags.DEFINE_string('baseline', '', 'A commit whose Checkpoints to time beside.')
  flags.DEFINE_integer('rounds', 3, 'Rounds; each times every side once.')
  flags.DEFINE_integer('saves', 10, 'Saves per side and round.')
  flags.DEFINE_string('label', 'current', 'Name of this measurement in the results.')
  flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                      'Where checkpoint_cost.json and checkpoint_cost.md go.')
  app.run(main)
