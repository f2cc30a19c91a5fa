"""Orbax checkpoints under `<workdir>/checkpoints/<step>/`: the training state and where the data was.

Each checkpoint holds `state`, the tree {'params': ..., 'opt_state': ...} as Orbax saves any
tree (`ocp.StandardCheckpointer().restore(<step>/state)` reads it without this code); `layout`
(JSON), each array's path, shape and dtype, which a restore checks first; and `meta` (JSON: step,
data position and the device count the data was sharded over). Checkpoints of earlier versions
are read too: those whose state is packed, one vector per dtype (kernels/packing.py), and those
without a layout. Every process calls save and restore: Orbax coordinates the writes.
"""

import concurrent.futures
import logging as std_logging
import math
import os
import re
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from transformer import files, train_step
from transformer.kernels.packing import unpack

STATE, META, LAYOUT = 'state', 'meta', 'layout'
CHECKPOINTS_DIR = 'checkpoints'  # in a workdir


def _orbax_warnings_only(record) -> bool:
  """Orbax logs each stage of every save and restore at INFO: dozens of lines per checkpoint.
  Its warnings and errors pass, without the traceback of an exception it raises on, which ends
  as one line (`CheckpointError`)."""
  if '/orbax/' not in record.pathname:
    return True
  record.exc_info = record.exc_text = None
  return record.levelno >= std_logging.WARNING


def local_copy(tree):
  """A host copy of a tree replicated over devices.

  Args:
    tree: arrays with a leading device axis, as `jax.pmap` returns them.

  Returns:
    The same tree of numpy arrays, from this process's first device, without the device axis.
  """
  return jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_shards[0].data)[0], tree)


_LAYOUTS = {}  # (tree structure, shapes and dtypes) -> its layout


def layout(tree) -> list[list]:
  """[path, shape, dtype] of each of `tree`'s arrays, in its leaves' order (in which an earlier
  version's packed checkpoints concatenated them, kernels/packing.py). Made once per structure: naming the paths at every save held the interpreter, which the
  training loop shares."""
  leaves, structure = jax.tree_util.tree_flatten(tree)
  key = structure, tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves)
  if key not in _LAYOUTS:
    _LAYOUTS[key] = [[jax.tree_util.keystr(path), list(shape), dtype] for (path, _), (shape, dtype)
                     in zip(jax.tree_util.tree_leaves_with_path(tree), key[1])]
  return _LAYOUTS[key]


def on_schedule(config):
  """Whether a checkpoint's step is one the config's schedule saves at (every
  checkpoint_every_steps, and the last), as against one a preemption or the clock added: the
  checkpoints a run keeps and averages are the scheduled ones, so that a preempted run is scored
  with the parameters an uninterrupted one is. Without a step schedule every step counts."""
  every, last = config.checkpoint_every_steps, config.num_train_steps
  return lambda step: every == 0 or step % every == 0 or step == last


class Checkpoints:
  """A run's Orbax checkpoints in `<workdir>/checkpoints/<step>/`: each holds a state tree and a
  JSON dict (step, data position, ...). Saves in the background, keeps the `keep` newest scheduled
  checkpoints and the newest of all (to resume from), restores any kept step.

  Args:
    workdir: the run's directory, local or gs://.
    keep: how many of the newest scheduled checkpoints to keep; None keeps all.
    scheduled: whether a step is on the run's schedule (`on_schedule`); None: every step.
    read_only: only read: nothing is made or removed (a run may be writing them).
    after_failure: what a save that fails means and what to do, for its error; None: training's
      (the run stops; resume with the same command).

  Raises:
    CheckpointError: `<workdir>/checkpoints` cannot be a directory (a file in its place).
  """

  def __init__(self, workdir: str, keep: int | None = None, scheduled=None,
               read_only: bool = False, after_failure: str | None = None):
    logging.get_absl_handler().addFilter(_orbax_warnings_only)  # once: a filter is a set member
    self.directory = os.path.join(files.absolute(workdir), CHECKPOINTS_DIR)
    self.keep, self.scheduled = keep, scheduled or (lambda step: True)
    self._after_failure = after_failure
    try:
      self.manager = ocp.CheckpointManager(
          self.directory, item_names=(STATE, META, LAYOUT),
          # A writer removes the temporary directories of a save that failed or was cut short.
          options=ocp.CheckpointManagerOptions(
              create=not read_only, read_only=read_only, cleanup_tmp_directories=not read_only,
              enable_async_checkpointing=True))
    except OSError as error:  # a file in its place; no permission
      raise CheckpointError(f'{self.directory} cannot be read as a directory of checkpoints '
                            f'({error.strerror or error}); move it away') from None
    # Orbax's asynchronous save still blocks its caller while it copies the state and makes the
    # checkpoint's directories, so saves start on a thread of their own. Several
    # processes save from the main thread, where Orbax's barriers keep them in step.
    self._saver = (concurrent.futures.ThreadPoolExecutor(1, 'checkpoint_save')
                   if jax.process_count() == 1 else None)
    self._saving = []  # the saver's futures not yet checked
    self._unchecked = None  # (step, bytes) of a save `_prune` has not checked (several processes)
    self._failed = None  # the step of a save that failed: later ones are not started
    _drop_closed_loop_reports()  # a failed save leaves Orbax's reads and writes such reports too

  def _saved(self, pending: int = 0):
    """Waits until all saves but the last `pending` are done (on one process: written); raises
    the error of one that failed."""
    while len(self._saving) > pending:
      self._saving.pop(0).result()

  def check(self):
    """Raises the error of a save that failed (`CheckpointError`) once it is known; returns at
    once: a training loop calls it every step, so that a failed save stops the run."""
    while self._saving and self._saving[0].done():
      self._saving.pop(0).result()

  def all_steps(self) -> list[int]:
    """The steps of the kept checkpoints, oldest first."""
    self._saved()
    return list(self.manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None if there is none."""
    self._saved()
    return self.manager.latest_step()

  def save(self, step: int, state_tree, meta: dict):
    """Starts writing a checkpoint; returns before the write finishes (`wait` waits for it).

    Args:
      step: the training step it is named by.
      state_tree: a host copy of the state (`local_copy`).
      meta: JSON-serialisable facts beside it (step, data position, ...).
    """
    def save():
      self.manager.save(step, args=ocp.args.Composite(**{
          STATE: ocp.args.StandardSave(state_tree), META: ocp.args.JsonSave(meta),
          LAYOUT: ocp.args.JsonSave({'arrays': layout(state_tree), 'packed': False})}),
                        force=True)

    size = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(state_tree))
    if self._saver is None:  # the previous save is checked first, not waited for after
      self._prune()
      save()
      self._unchecked = step, size
      return
    def save_and_check():
      if self._failed is not None:  # a save before this one failed: the run is stopping
        return
      try:
        save()
        self._prune(step, size)
      except BaseException:
        self._failed = step
        raise

    self.check()
    self._saved(pending=1)  # each waiting save holds a copy of the state: one at most
    # On its own thread, which waits for the write: a failure is known at once (`check`).
    self._saving.append(self._saver.submit(save_and_check))

  def restore(self, step: int, like):
    """Reads checkpoint `step`.

    Args:
      step: one of `all_steps()`.
      like: a tree of the state's shapes and dtypes (`state_shapes`).

    Returns:
      (the state tree as numpy arrays shaped as `like`, the meta dict).

    Raises:
      CheckpointError: a file of it is damaged or missing, or it holds other arrays than `like`;
        the message names the directory and what to do.
    """
    self.wait()
    has_layout = (epath.Path(self.directory) / str(step) / LAYOUT).exists()
    packed = False  # an earlier version's: one vector per dtype
    try:
      if has_layout:
        arrays = layout(like)
        packed = self._check_layout(step, arrays)
      if packed:
        sizes = {}
        for _, shape, dtype in arrays:
          sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
        target = {dtype: np.zeros(size, dtype) for dtype, size in sizes.items()}
      else:
        target = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), like)
      restored = self.manager.restore(step, args=ocp.args.Composite(**{
          STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()}))
    except CheckpointError:
      raise
    except Exception as error:  # Orbax and TensorStore raise many kinds for a damaged file
      raise CheckpointError(self._unreadable(step, error)) from None
    state = unpack(restored[STATE], like) if packed else restored[STATE]
    return state, restored[META]

  def _check_layout(self, step: int, expected: list[list]) -> bool:
    """Raises CheckpointError unless checkpoint `step` holds the arrays of layout `expected`;
    returns whether they are packed (an earlier version's checkpoint)."""
    stored_layout = self.manager.restore(step, args=ocp.args.Composite(**{
        LAYOUT: ocp.args.JsonRestore()}))[LAYOUT]
    stored = stored_layout['arrays']
    if stored != expected:
      first = next((i for i, (a, b) in enumerate(zip(stored, expected)) if a != b),
                   min(len(stored), len(expected)))
      name = lambda arrays: ' '.join(map(str, arrays[first])) if first < len(arrays) else 'none'
      raise CheckpointError(
          f'{os.path.join(self.directory, str(step))} holds other arrays than this config\'s '
          f'state ({len(stored)} against {len(expected)}; the first difference: {name(stored)} '
          f'where {name(expected)} is expected): it was written by another model, or by other '
          'versions of flax or optax; restore it with the config and versions that wrote it')
    return stored_layout.get('packed', True)

  def _unreadable(self, step: int, error: Exception) -> str:
    earlier = [s for s in self.all_steps() if s < step]
    fix = (f'delete that directory to use checkpoint {earlier[-1]} instead' if earlier else
           'it is the only checkpoint: delete it to start again from scratch')
    reason = (str(error).strip().splitlines() or [''])[0][:300]
    return (f'{os.path.join(self.directory, str(step))} cannot be read, a file in it is damaged '
            f'or missing ({type(error).__name__}: {reason}); {fix}')

  def mean_params(self, count: int, like,
                  up_to_step: int | None = None) -> tuple[dict, list[int]]:
    """The mean parameters of the newest `count` checkpoints (all, if fewer are kept).

    Args:
      count: how many checkpoints to average.
      like: as in `restore`.
      up_to_step: only checkpoints at or before this step count (None: all).

    Returns:
      (the mean parameters, the steps averaged).
    """
    chosen = self.averaged_steps(count, up_to_step)
    return average([self.restore(step, like)[0]['params'] for step in chosen]), chosen

  def averaged_steps(self, count: int, up_to_step: int | None = None) -> list[int]:
    """The newest `count` scheduled checkpoints' steps (all of them, if fewer are kept); the
    newest of any kind where none is scheduled (a run preempted before its first). With
    `up_to_step`, the same among the checkpoints at or before it."""
    steps = [s for s in self.all_steps() if up_to_step is None or s <= up_to_step]
    return [step for step in steps if self.scheduled(step)][-count:] or steps[-1:]

  def _prune(self, step: int | None = None, size: int = 0):
    """Waits for the saves under way, then deletes the checkpoints beyond the `keep` newest
    scheduled ones, but the newest.

    Args:
      step: the step of the last save, to check that it was written; None: the one `save`
        left unchecked, if any.
      size: its bytes, which a failure reports.

    Raises:
      CheckpointError: that save failed; what it left is removed, and the message says why, with
        the space left.
    """
    if step is None and self._unchecked is not None:
      (step, size), self._unchecked = self._unchecked, None
    try:
      self.manager.wait_until_finished()
      failure = None
    except Exception as error:  # Orbax and TensorStore raise many kinds for a failed write
      failure = error
    if step is not None and (failure is not None or step not in self.manager.all_steps()):
      raise CheckpointError(self._unwritten(step, size, failure))
    if self.keep is None:
      return
    steps = list(self.manager.all_steps())
    kept = set([step for step in steps if self.scheduled(step)][-self.keep:] + steps[-1:])
    for step in steps:
      if step not in kept:
        self.manager.delete(step)

  def _unwritten(self, step: int, size: int, failure: Exception | None) -> str:
    """Removes what the failed save of `step` left, and says what happened."""
    self._remove_unwritten(step)
    # Orbax's write tasks that failed with it can be collected later, after this message, and
    # asyncio then logs their error again with a traceback.
    std_logging.getLogger('asyncio').setLevel(std_logging.CRITICAL)
    reason = (getattr(failure, 'strerror', None) or (str(failure).strip().splitlines() or [''])[0]
              if failure else 'not written')
    if code := re.search(r"os_error_code='(\d+)'", reason):  # TensorStore's message ends with it
      reason = os.strerror(int(code.group(1)))
    space = f'a checkpoint takes {size / 2**20:.2f} MiB'
    if (free := files.free_mib(self.directory)) is not None:
      space += f', {free:.2f} MiB are free there'
    unwritten = (f'checkpoint {step} could not be written to {self.directory} ({reason[:300]}; '
                 f'{space})')
    if self._after_failure is not None:
      return f'{unwritten}: {self._after_failure}'
    written = [s for s in self.manager.all_steps() if s != step]
    kept = (f'the latest checkpoint, step {written[-1]}, is whole' if written else
            'no checkpoint was written before it')
    return (f'{unwritten}: training stopped; {kept}. Free space (or lower keep_checkpoints) and '
            'run the same command again to resume')

  def wait(self):
    """Returns once every started save is written (and what it leaves behind deleted)."""
    self._saved()
    self._prune()

  def _remove_unwritten(self, step: int):
    """Removes the directories of a save of `step` that failed. Writes of it still in flight
    may refill one: `close` removes them again, and a writer's next start too."""
    for path in epath.Path(self.directory).glob(f'{step}*'):
      if path.name == str(step) or path.name.startswith(f'{step}.'):  # its temporary copies
        try:
          path.rmtree(missing_ok=True)
        except OSError:
          pass

  def close(self):
    """Waits for the saves and releases Orbax's resources."""
    try:
      self._saved()
    finally:
      if self._saver is not None:
        self._saver.shutdown()
      try:
        self.manager.close()
      except Exception:  # Orbax raises a failed save's error again: already a CheckpointError
        if self._failed is None:
          raise
      if self._failed is not None:  # writes in flight when it failed may have made more
        self._remove_unwritten(self._failed)


def _drop_closed_loop_reports():
  """When one read of a restore (or write of a save) fails, the reads still in flight call back
  into Orbax's event loop after it closed, and Python prints each `RuntimeError('Event loop is
  closed')` as a traceback around our one-line error: drop exactly those reports (installed
  once)."""
  previous = sys.unraisablehook
  if getattr(previous, 'drops_closed_loop_reports', False):
    return

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and
            str(unraisable.exc_value) == 'Event loop is closed'):
      previous(unraisable)
  hook.drops_closed_loop_reports = True
  sys.unraisablehook = hook


class CheckpointError(RuntimeError):
  """No usable checkpoint; the message names the directory and what to do."""


def average(trees: list):
  """The element-wise mean of same-shaped trees, accumulated in float64.

  Args:
    trees: trees of numpy arrays with the same structure, shapes and dtypes.

  Returns:
    Their mean, in the trees' dtypes.
  """
  total = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), trees[0])
  for tree in trees[1:]:
    total = jax.tree_util.tree_map(lambda t, x: t + x, total, tree)
  return jax.tree_util.tree_map(lambda t, x: (t / len(trees)).astype(x.dtype), total, trees[0])


def latest_step(workdir: str) -> int | None:
  """The step of the newest checkpoint in `workdir`, or None."""
  if not epath.Path(workdir, CHECKPOINTS_DIR).is_dir():
    return None
  checkpoints = Checkpoints(workdir, read_only=True)
  try:
    return checkpoints.latest_step()
  finally:
    checkpoints.close()


def state_shapes(config):
  """The shapes of a run's checkpointed state, computed without allocating it.

  Args:
    config: a validated experiment config.

  Returns:
    {'params': ..., 'opt_state': ...} of `jax.ShapeDtypeStruct`s, the `like` of `restore`.
  """
  state = jax.eval_shape(lambda: train_step.initial_state(config))
  return {'params': state.params, 'opt_state': state.opt_state}


def _named(steps: list[int]) -> str:
  """`steps` as an error names them: all of a few, the ends of many."""
  if len(steps) <= 6:
    return f'steps {steps}'
  return f'{len(steps)} steps: {steps[0]}, {steps[1]}, ..., {steps[-2]}, {steps[-1]}'


def load_params(workdir: str, config, average_last: int | None = None,
                up_to_step: int | None = None):
  """The parameters to evaluate a run with: the mean of its last checkpoints, as the paper does.

  Args:
    workdir: a train.py workdir.
    config: its config (`stored_config.load_workdir_config`).
    average_last: how many checkpoints to average; None: config.average_last, or all that are
      kept if fewer (an unfinished run). An explicit number must not exceed what is kept.
    up_to_step: only the checkpoints at or before this step count, the run as it stood then
      (None: all).

  Returns:
    (the mean parameters as numpy arrays, the steps averaged).

  Raises:
    CheckpointError: no checkpoint, too few, or a damaged one; the message says what to do.
  """
  checkpoints = Checkpoints(workdir, scheduled=on_schedule(config), read_only=True)
  try:
    kept = checkpoints.all_steps()
    steps = checkpoints.averaged_steps(len(kept), up_to_step)
    if not steps and kept:
      raise CheckpointError(f'{checkpoints.directory} holds no checkpoint at or before step '
                            f'{up_to_step} ({_named(kept)}); ask for a later step')
    if not steps and epath.Path(checkpoints.directory).is_file():
      raise CheckpointError(f'{checkpoints.directory} is a file where train.py keeps its '
                            'checkpoints directory; give the workdir whose checkpoints/ holds them')
    if not steps:
      raise CheckpointError(f'{checkpoints.directory} holds no checkpoint; train first')
    held = (f'{len(steps)} scheduled checkpoints' +
            ('' if up_to_step is None else f' at or before step {up_to_step}'))
    if average_last is None:
      average_last = min(config.average_last, len(steps))
      if average_last < config.average_last:
        logging.warning('config.average_last=%d, but %s holds %s: averaging those',
                        config.average_last, checkpoints.directory, held)
    elif not 1 <= average_last <= len(steps):
      raise CheckpointError(f'average_last={average_last}, but {checkpoints.directory} holds '
                            f'{held} ({_named(steps)}); ask for 1 to {len(steps)}')
    return checkpoints.mean_params(average_last, state_shapes(config), up_to_step)
  finally:
    checkpoints.close()


def write_average(workdir: str, output_workdir: str, config, last: int,
                  up_to_step: int | None = None) -> list[int]:
  """Writes the mean parameters of a run's last checkpoints as a checkpoint of a new workdir.

  It takes the newest averaged checkpoint's step, optimizer state and data position, so the
  output can be evaluated like any run, or trained on.

  Args:
    workdir: the run to average.
    output_workdir: a directory without checkpoints, for the average.
    config: the run's config.
    last: how many of the newest checkpoints to average.
    up_to_step: only the checkpoints at or before this step count (None: all).

  Returns:
    The steps averaged.

  Raises:
    CheckpointError: as `load_params`, or `output_workdir` holds checkpoints already.
  """
  existing = Checkpoints(output_workdir, read_only=True)  # a writer would tidy a run's files
  try:
    if existing.all_steps():
      raise CheckpointError(f'{existing.directory} already holds checkpoints; choose a new '
                            'directory')
  finally:
    existing.close()
  params, steps = load_params(workdir, config, last, up_to_step)
  source = Checkpoints(workdir, read_only=True)
  try:
    newest, meta = source.restore(steps[-1], state_shapes(config))
  finally:
    source.close()
  target = Checkpoints(output_workdir, after_failure='the average was not written; free '
                       'space and run the same command again')
  try:
    target.save(steps[-1], {'params': params, 'opt_state': newest['opt_state']},
                dict(meta, averaged_steps=steps))
    target.wait()
  finally:
    target.close()
  return steps
