"""Which implementation each op runs on this machine: a pure function of the config and the
machine (`choose`), and the machine's own choice, logged once (`for_this_machine`).

Every choice computes the same thing; the config's '' or 0 means "the fastest this machine runs"
(README.md in this folder gives the measurements behind each default).
"""

import dataclasses

import jax
import ml_collections
from absl import logging

from transformer.config import ConfigError
from transformer.kernels import pallas_attention


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the choices depend on: jax's backend and its first device."""

  backend: str  # 'cpu', 'gpu' or 'tpu'
  device_kind: str = ''
  compute_capability: str = ''  # NVIDIA GPUs' 'major.minor'; ROCm's is a gfx name
  local_devices: int = 1

  @classmethod
  def here(cls) -> 'Machine':
    device = jax.local_devices()[0]
    return cls(jax.default_backend(), device.device_kind,
               str(getattr(device, 'compute_capability', '')), jax.local_device_count())

  @property
  def runs_fused_kernels(self) -> bool:
    """NVIDIA GPUs of compute capability 8.0 or later (Ampere, where bfloat16 tensor cores start;
    the kernels are tuned on Hopper). Elsewhere XLA's implementations compute the same."""
    major, _, minor = self.compute_capability.partition('.')
    return (self.backend == 'gpu' and major.isdigit() and minor.isdigit() and
            (int(major), int(minor)) >= (8, 0))

  def __str__(self) -> str:
    if self.backend != 'gpu':
      return self.backend
    return f'{self.device_kind}, compute capability {self.compute_capability or "unknown"}'


@dataclasses.dataclass(frozen=True)
class Implementations:
  """How a run computes; every field gives the same results, at another speed.

  Attributes:
    attention: 'xla' (`model.dot_product_attention`), 'cudnn' or 'pallas' (kernels/attention.py).
    attention_projection: 'heads' (DenseGeneral's product) or 'matrix' (`attention.matrix_product`).
    loss_chunk: target positions per chunk of the loss's output projection; None: all at once.
    loss_reduction: 'separate' or 'online' (kernels/loss.py).
    decode_batch_tokens: source tokens times beam_size per beam-search call and device.
  """

  attention: str = 'xla'
  attention_projection: str = 'heads'
  loss_chunk: int | None = None
  loss_reduction: str = 'separate'
  decode_batch_tokens: int = 2**17


def _attention(config: ml_collections.ConfigDict, machine: Machine) -> str:
  """config.implementation.attention, or by machine where it is '': the Pallas kernels where
  heads have a depth that is a power of 2 from 16 and max_length is up to their rows, else cuDNN's where the depth is a multiple of 8 up
  to 128, on a machine that runs them, in bfloat16 or float16 without attention dropout; else
  XLA's."""
  chosen = config.implementation.attention
  depth = config.model.d_model // config.model.num_heads
  # The fused kernels project without biases (an imported Marian's attention has them).
  fused = (machine.runs_fused_kernels and config.model.dtype in ('bfloat16', 'float16') and
           config.model.attention_dropout_rate == 0 and
           not config.model.get('attention_bias', False))
  cudnn_runs = fused and depth % 8 == 0 and depth <= 128
  pallas_runs = (fused and depth >= 16 and depth & (depth - 1) == 0 and
                 config.max_length <= pallas_attention.MAX_LENGTH)
  needs = (f'an NVIDIA GPU of compute capability 8.0 or later (here: {machine}), model.dtype '
           f'bfloat16 or float16 (now {config.model.dtype!r}), model.attention_dropout_rate=0 '
           f'(now {config.model.attention_dropout_rate}), model.attention_bias=False (now '
           f'{config.model.get("attention_bias", False)}) and ')
  if chosen == 'cudnn' and not cudnn_runs:
    raise ConfigError(
        f"config.implementation.attention='cudnn': cuDNN attention needs {needs}"
        f"d_model / num_heads a multiple of 8 up to 128 (now {depth}); use 'xla' or '' (by "
        'machine)')
  if chosen == 'pallas' and not pallas_runs:
    raise ConfigError(
        f"config.implementation.attention='pallas': the fused attention kernels need "
        f'{needs}d_model / num_heads a power of 2 from 16 (now {depth}) and max_length up to '
        f"{pallas_attention.MAX_LENGTH} (now {config.max_length}); use 'xla' or '' (by machine)")
  return chosen or ('pallas' if pallas_runs else 'cudnn' if cudnn_runs else 'xla')


def choose(config: ml_collections.ConfigDict, machine: Machine) -> Implementations:
  """The implementations a validated config runs with on `machine`.

  Where the config leaves one open ('' or 0): the attention by `_attention`; the projections
  'heads' on a CPU, 'matrix' elsewhere; loss chunks of 256 on a CPU, none on an accelerator,
  where a chunk loop runs its steps one after another; the 'online' loss on a GPU, where each
  pass over the logits is memory-bound, 'separate' elsewhere (a CPU runs the variadic reduction
  slower; a TPU is unmeasured); beam-search calls of the training batch's share of a device on a
  CPU, 2**17 tokens on an accelerator.

  Raises:
    ConfigError: the config names a fused kernel this machine or config cannot run.
  """
  on_cpu, chosen = machine.backend == 'cpu', config.implementation
  return Implementations(
      attention=_attention(config, machine),
      attention_projection=chosen.attention_projection or ('heads' if on_cpu else 'matrix'),
      loss_chunk=chosen.loss_chunk_tokens or (256 if on_cpu else None),
      loss_reduction=chosen.loss_reduction or ('online' if machine.backend == 'gpu' else
                                               'separate'),
      decode_batch_tokens=chosen.decode_batch_tokens or (
          config.tokens_per_batch // (config.grad_accum_steps * machine.local_devices)
          if on_cpu else 2**17))


_logged = set()


def for_this_machine(config: ml_collections.ConfigDict) -> Implementations:
  """`choose` for this process's machine; each distinct choice is logged once."""
  machine = Machine.here()
  implementations = choose(config, machine)
  if (machine, implementations) not in _logged:
    _logged.add((machine, implementations))
    logging.info('on %s: %s', machine, implementations)
  return implementations


def runnable_here(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A stored run's config whose implementation.attention, if this machine cannot run it, is ''
  (by machine), with a warning: it chooses how the model computes, not what, so a run trained
  with a GPU's kernels translates anywhere."""
  config = ml_collections.ConfigDict(config.to_dict())
  try:
    _attention(config, Machine.here())
  except ConfigError:
    logging.warning("config.implementation.attention=%r: not on this machine (%s); '' instead",
                    config.implementation.attention, Machine.here())
    config.implementation.attention = ''
  return config
