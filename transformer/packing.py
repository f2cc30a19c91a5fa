"""Trees of arrays as one vector per dtype, and back.

The training steps take their state this way (train_step.py), and checkpoints store it this way
(checkpoints.py): each array of a tree costs a call, a save or a transfer its own work, and the
base model's state has 546 of them.
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
