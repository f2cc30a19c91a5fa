"""Faster implementations of the model's ops: the same results, fewer passes over memory.

One module per op; `transformer/model.py` calls each at one site, beside the plain form it
replaces, through the names below (decode.py a beam search step's `best_continuations`).
README.md in this folder says what each buys and how to switch it off; `choice.py` picks them for
the machine a run is on.
"""

from transformer.kernels.attention import (ProjectionWeights, applies, fused_attention,
                                           projection_product)
from transformer.kernels.dropout import dropout, is_hash_key
from transformer.kernels.logits import low_precision_logits
from transformer.kernels.relu import relu
from transformer.kernels.top_k import best_continuations, top_k

__all__ = ['ProjectionWeights', 'applies', 'best_continuations', 'dropout', 'fused_attention',
           'is_hash_key', 'low_precision_logits', 'projection_product', 'relu', 'top_k']
