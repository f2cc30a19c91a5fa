"""Trees of arrays as one vector per dtype, and back.

The training steps take their state this way (train_step.py), and checkpoints store it this way
(checkpoints.py): each array of a tree costs a call, a save or a transfer its own work, and the
base model's state has 546 of them. Adam then updates all parameters in one kernel.
"""

import math

import jax
import numpy as np


def pack(tree, xp=np) -> dict:
  """`tree`'s arrays flattened and concatenated in its leaves' order, one vector per dtype name.

  Args:
    tree: arrays; numpy's on the host, traced ones inside a jitted function.
    xp: the array module to concatenate with: numpy, or jax.numpy inside a jitted function.
  """
  parts = {}
  for x in jax.tree_util.tree_leaves(tree):
    parts.setdefault(np.dtype(x.dtype).name, []).append(xp.ravel(x))
  return {dtype: xp.concatenate(arrays) for dtype, arrays in parts.items()}


def unpack(vectors: dict, like):
  """The tree shaped as `like` (arrays or ShapeDtypeStructs) whose arrays `pack` concatenated into
  `vectors`: views of numpy vectors, slices of traced ones."""
  taken = dict.fromkeys(vectors, 0)
  leaves = []
  for x in jax.tree_util.tree_leaves(like):
    dtype, size = np.dtype(x.dtype).name, math.prod(x.shape)
    leaves.append(vectors[dtype][taken[dtype]:taken[dtype] + size].reshape(x.shape))
    taken[dtype] += size
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def _map_param_trees(fn, tree, structure):
  """`tree` with `fn` applied to each of its subtrees of `structure` (the optimizer state's trees
  shaped as the parameters)."""
  matches = lambda x: jax.tree_util.tree_structure(x) == structure
  return jax.tree_util.tree_map(lambda x: fn(x) if matches(x) else x, tree, is_leaf=matches)


def pack_state(state, xp=np):
  """A flax TrainState `state` (host arrays; traced ones with `xp` jax.numpy) as the steps take
  it: the parameters, and each tree of the optimizer's state shaped as them (Adam's moments), as
  one vector per dtype (`pack`)."""
  structure = jax.tree_util.tree_structure(state.params)
  pack_tree = lambda tree: pack(tree, xp)
  return state.replace(params=pack_tree(state.params),
                       opt_state=_map_param_trees(pack_tree, state.opt_state, structure))


def unpack_state(state, params_like):
  """`pack_state`'s inverse: the trees shaped as `params_like` (views of the host vectors)."""
  unpack_tree = lambda vectors: unpack(vectors, params_like)
  structure = jax.tree_util.tree_structure(state.params)
  return state.replace(params=unpack_tree(state.params),
                       opt_state=_map_param_trees(unpack_tree, state.opt_state, structure))
