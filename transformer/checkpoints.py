"""Orbax checkpoints under `<workdir>/checkpoints/<step>/`: the training state and where the data was.

Each checkpoint holds `state` (parameters and optimizer state, host numpy copies) and `meta` (JSON:
step and data position). Every process calls save and restore: Orbax coordinates the writes.
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

STATE, META = 'state', 'meta'


def local_copy(tree):
  """Host numpy copy of a tree replicated over devices (from this process's first device)."""
  return jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_shards[0].data)[0], tree)


class Checkpoints:
  """Saves asynchronously and keeps the `keep` most recent; restores any kept step."""

  def __init__(self, workdir: str, keep: int | None = None):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=(STATE, META),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=True))

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state_tree, meta: dict):
    """Starts writing `state_tree` (a host copy) and `meta`; returns before the write finishes."""
    self.manager.save(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(state_tree), META: ocp.args.JsonSave(meta)}), force=True)

  def restore(self, step: int, like):
    """(state tree shaped as `like`, meta dict) of checkpoint `step`, as numpy arrays."""
    target = jax.tree_util.tree_map(
        lambda x: np.zeros(np.shape(x), np.asarray(x).dtype), like)
    restored = self.manager.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()}))
    return restored[STATE], restored[META]

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()
