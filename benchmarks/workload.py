"""What the speed benchmarks time: our model at configs/multi30k.py's size or the paper's base size
(configs/default.py), with a variant's config overrides, and flax's examples/wmt at the same size,
on random batches.
"""

import collections
import functools
import importlib
import importlib.util
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
import types

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from flax import jax_utils
from ml_collections import config_flags

from configs import multi30k
from transformer import commands, decode, metrics, model, train_step
from transformer import config as config_lib
from transformer.data import batching
from transformer.kernels import choice, packing

CONFIG_FILES = {'multi30k': 'multi30k.py', 'base': 'default.py'}  # in configs/


def load_config(variant: str, size: str = 'multi30k'):
  """The config of `size` with the variant's space-separated key=value overrides, parsed as
  train.py parses its --config.key=value; a value with spaces is quoted as in a shell:
  xla_flags='--xla_a=1 --xla_b=2'."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  argv = ['benchmark', f'--config={os.path.join(root, "configs", CONFIG_FILES[size])}',
          *(f'--config.{o}' for o in shlex.split(variant))]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  try:
    commands.parse_flags(argv, flag_values)
  except (config_lib.ConfigError, flags.Error) as error:
    raise SystemExit(f'--variant={variant!r}: {error}') from None
  return flag_values.config


def like_flax(config):
  """A copy of `config` shaped as flax examples/wmt's model: dropout also on the feed-forward
  hidden layer, at the sub-layers' rate (flax's MlpBlock), pre-norm layers, each stack ending in a
  LayerNorm, and the output projection in float32."""
  config = config.copy_and_resolve_references()
  config.model.relu_dropout_rate = config.model.dropout_rate
  config.model.layer_norm = 'pre'
  config.model.output_projection_dtype = 'float32'
  return config


def random_batch(rng: np.random.Generator, rows: int, length: int, vocab_size: int) -> dict:
  """Sources and targets: random words, lengths uniform in [length/2, length], EOS, 0-padded."""
  batch = {}
  for side in ('sources', 'targets'):
    tokens = rng.integers(3, vocab_size, (rows, length), dtype=np.int32)
    lengths = rng.integers(length // 2, length + 1, rows)
    tokens[np.arange(rows), lengths - 1] = decode.EOS_ID
    batch[side] = np.where(np.arange(length) < lengths[:, None], tokens, 0).astype(np.int32)
  return batch


def packed_batch(rng: np.random.Generator, rows: int, length: int, vocab_size: int,
                 pair_lengths: tuple[int, int] = (5, 30)) -> dict:
  """A batch as train.py's with packing=True: pairs of random words, each side's length uniform in
  `pair_lengths` (most of Multi30k's sentences are 5-30 tokens long), ending in EOS, packed into
  rows by the data pipeline's own `batching.pack`, with segment ids (1, 2, ... in a row) and
  positions (0, 1, ... in a pair); the first `rows` rows it packs."""
  count = 2 * rows * length // pair_lengths[0]  # more pairs than the rows can hold
  lengths = {side: rng.integers(pair_lengths[0], pair_lengths[1] + 1, count)
             for side in ('source', 'target')}
  packed = batching.pack(lengths['source'], lengths['target'], np.arange(count), length)[:rows]
  batch = {name: np.zeros((rows, length), np.int32) for name in Flax.INPUT_NAMES}
  for row, pairs in enumerate(packed):
    for side in ('source', 'target'):
      ends = np.cumsum(lengths[side][pairs])
      starts = ends - lengths[side][pairs]
      for segment, (start, end) in enumerate(zip(starts, ends), 1):
        batch[f'{side}s'][row, start:end] = rng.integers(3, vocab_size, end - start)
        batch[f'{side}s'][row, end - 1] = decode.EOS_ID
        batch[f'{side}_segment_ids'][row, start:end] = segment
        batch[f'{side}_positions'][row, start:end] = np.arange(end - start)
  return batch


def compiler_options(config) -> dict:
  """config.xla_flags as XLA options of one program: train.py puts them in XLA_FLAGS, which
  holds for a whole process, so that variants timed side by side would share them."""
  options = {}
  for flag in config.get('xla_flags', '').split():
    name, value = flag.removeprefix('--').split('=', 1)
    options[name] = {'true': True, 'false': False}.get(value.lower(), value)  # XLA's bools
  return options


BEAM_SIZE, ALPHA, EXTRA_LENGTH = 4, 0.6, 50  # the beam search both sides run


class Side:
  """What both sides share: a pmapped train step (`p_train_step`, its `state` donated) compiled
  with XLA's `compiler_options`, and the parameters of a beam search. A side supplies the state,
  the step, the step's arguments after the state (`step_args`), its parameters on one device
  (`params`) and its embedding's name (`EMBEDDING`)."""

  def __init__(self, compiler_options: dict):
    self.compiler_options = compiler_options
    self._compiled = {}  # batch shapes -> the compiled train step

  def _compile(self, args, kwargs):
    return self.p_train_step.lower(self.state, *args, **kwargs).compile(
        compiler_options=self.compiler_options)

  def train(self, batch, steps: int = 1) -> float:
    """`steps` training steps on `batch`, waiting only for the last, as train.py waits only at
    log steps; the seconds the first took to return: the host's work for a step (its arguments,
    its program's launch). The step is the pmapped one, as train.py calls it, or with XLA options
    the program it compiles with them (pmap takes none), once per `batch`'s shapes, whose call
    costs the host a little less (0.28 against 0.33 ms for the Multi30k recipe's state on 2 CPU
    cores, a one-off timing)."""
    args, kwargs = self.step_args(batch)
    step = self.p_train_step
    if self.compiler_options:
      shapes = tuple(sorted((name, x.shape) for name, x in batch.items()))
      if shapes not in self._compiled:
        self._compiled[shapes] = self._compile(args, kwargs)
      step = self._compiled[shapes]
    called = time.perf_counter()
    self.state, metrics = step(self.state, *args, **kwargs)
    returned = time.perf_counter() - called
    for _ in range(steps - 1):
      self.state, metrics = step(self.state, *args, **kwargs)
    jax.block_until_ready(metrics)
    return returned

  def train_hlo(self, batch) -> str:
    """The train step's optimized HLO for `batch`."""
    return self._compile(*self.step_args(batch)).as_text()

  def beam_params(self):
    """The parameters, the EOS row of the embedding zeroed: EOS is never a top candidate, so that
    a search runs to its length limit."""
    params = self.params()
    table = params[self.EMBEDDING]['embedding']
    return {**params, self.EMBEDDING: {'embedding': table.at[decode.EOS_ID].set(0.0)}}


class Ours(Side):
  """Our model and steps at configs/multi30k.py's size, or with another `config`, with the
  implementations `machine` runs (default: this one's), its train step compiled with its
  config.xla_flags."""
  EMBEDDING = 'source_embedding'

  def __init__(self, config=None, machine: choice.Machine | None = None):
    self.config = config or multi30k.get_config()
    config_lib.validate(self.config)
    implementations = choice.choose(self.config, machine or choice.Machine.here())
    self.model_config = config_lib.model_config(self.config, implementations)
    self.steps = train_step.StepFunctions(self.config, implementations)
    state = train_step.initial_state(self.config)
    self.parameters = metrics.parameters_per_token(state.params)
    self.state = train_step.replicate(packing.pack_state(state))
    self.p_train_step = jax.pmap(self.steps.train_step, train_step.AXIS, donate_argnums=(0,))
    super().__init__(compiler_options(self.config))

  def step_args(self, batch):
    return (batch,), {}

  def params(self):
    return self.steps.params_tree(jax_utils.unreplicate(self.state.params))

  def training_forward(self, batch):
    """As `Flax.training_forward`."""
    rngs = {'dropout': jax.random.key(0, impl=self.steps.rng_impl)}
    apply = self.steps.train_model.apply
    return self.params(), lambda params: apply({'params': params}, **batch, rngs=rngs)

  def beam_search(self, params, sources):
    """As `Flax.beam_search`, and the steps the search ran."""
    tokens, _, steps = decode.beam_search(self.model_config, params, sources, beam_size=BEAM_SIZE,
                                          alpha=ALPHA, extra_length=EXTRA_LENGTH)
    return jax.block_until_ready(tokens[:, 0]), int(steps)


def parse_shape(text: str) -> tuple[int, int]:
  rows, length = text.split('x')
  return int(rows), int(length)


FLAX_DIR = os.path.join(os.path.expanduser('~'), '.cache', 'transformer-nmt',
                        f'flax-{flax.__version__}-examples-wmt')
FLAX_FILES = ('models.py', 'decode.py', 'train.py', 'bleu.py')


def fetch_flax_examples(directory: str) -> str:
  """examples/wmt of the installed flax version's sdist, extracted once into `directory`.

  Raises:
    SystemExit: pip cannot fetch it (no network, no such version on the index); one line that
      says where to put the files by hand.
  """
  if all(os.path.exists(os.path.join(directory, f)) for f in FLAX_FILES):
    return directory
  with tempfile.TemporaryDirectory() as tmp:
    fetched = subprocess.run([sys.executable, '-m', 'pip', 'download', f'flax=={flax.__version__}',
                              '--no-deps', '--no-binary', ':all:', '--quiet', '-d', tmp],
                             capture_output=True, text=True, check=False)
    if fetched.returncode:
      why = (fetched.stderr.strip().splitlines() or ['no output'])[-1]
      raise SystemExit(f'the flax {flax.__version__} sdist, whose examples/wmt is the reference, '
                       f'could not be fetched (pip download: {why}); put its examples/wmt/ '
                       f'{", ".join(FLAX_FILES)} in {directory} (--flax_dir), or run where PyPI '
                       'is reachable')
    (sdist,) = [f for f in os.listdir(tmp) if f.endswith('.tar.gz')]
    os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(directory)))
    with tarfile.open(os.path.join(tmp, sdist)) as archive:
      for member in archive.getmembers():
        if os.path.basename(member.name) in FLAX_FILES and '/examples/wmt/' in member.name:
          with archive.extractfile(member) as src, open(
              os.path.join(staging, os.path.basename(member.name)), 'wb') as dst:
            dst.write(src.read())
    os.replace(staging, directory)
  return directory


def import_flax_wmt(directory: str):
  """(models, decode, train) modules of flax examples/wmt, tensorflow and clu stubbed while they
  import."""
  importlib.import_module('flax.training.checkpoints')  # decides on tensorflow before the stub
  # Its tf.data input pipeline is not timed, so it is stubbed with the modules it needs; the
  # stubs leave sys.modules afterwards (a stub found there fails importlib.util.find_spec).
  stubs = [name for name in ('tensorflow', 'clu', 'clu.metric_writers', 'clu.periodic_actions',
                             'input_pipeline') if name not in sys.modules]
  for name in stubs:
    sys.modules[name] = types.ModuleType(name)
  sys.modules['tensorflow'].data = types.SimpleNamespace(Dataset=object)  # in annotations
  modules = {}
  sys.path.insert(0, directory)
  try:
    # train.py imports its siblings by their bare names; load it under a name of its own.
    for name in ('models', 'decode'):
      modules[name] = importlib.import_module(name)
    spec = importlib.util.spec_from_file_location('flax_wmt_train',
                                                  os.path.join(directory, 'train.py'))
    modules['train'] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modules['train'])
  finally:
    sys.path.remove(directory)
    for name in stubs:
      del sys.modules[name]
  return modules['models'], modules['decode'], modules['train']


class Flax(Side):
  """flax examples/wmt at the same size, run as its train.py runs it: its train step compiled with
  XLA's defaults, or with `compiler_options` (ours', for a like-for-like comparison)."""
  EMBEDDING = 'shared_embedding'

  def __init__(self, directory: str, ours: Ours, compiler_options: dict | None = None):
    self.models, self.decode, self.train_module = import_flax_wmt(directory)
    m = ours.model_config
    self.model_config = self.models.TransformerConfig(
        vocab_size=m.vocab_size, output_vocab_size=m.vocab_size, share_embeddings=True,
        logits_via_embedding=True, dtype=m.dtype, emb_dim=m.d_model, num_heads=m.num_heads,
        num_layers=m.num_encoder_layers, qkv_dim=m.d_model, mlp_dim=m.d_ff,
        max_len=512, dropout_rate=m.dropout_rate, attention_dropout_rate=m.attention_dropout_rate,
        deterministic=False, decode=False)
    learning_rate = self.train_module.create_learning_rate_schedule(2e-3, 1000)
    tokens = jnp.ones((1, 8), jnp.float32)
    params = jax.jit(self.models.Transformer(self.model_config.replace(deterministic=True)).init)(
        jax.random.key(0), tokens, tokens)['params']
    state = self.train_module.TrainState.create(
        apply_fn=None, params=params, tx=optax.adamw(learning_rate, b1=0.9, b2=0.98, eps=1e-9,
                                                     weight_decay=0.0), dynamic_scale=None)
    self.state = jax_utils.replicate(state)
    self.train_step = functools.partial(  # per device; its dropout_rng by keyword
        self.train_module.train_step, config=self.model_config, learning_rate_fn=learning_rate,
        label_smoothing=0.1)
    self.p_train_step = jax.pmap(self.train_step, axis_name='batch', donate_argnums=(0,))
    self.dropout_rngs = jax.random.split(jax.random.key(1), jax.local_device_count())
    self.predict_config = self.model_config.replace(deterministic=True, decode=True)
    super().__init__(compiler_options or {})

  def step_args(self, batch):
    return (self.inputs(batch),), {'dropout_rng': self.dropout_rngs}

  def params(self):
    return jax_utils.unreplicate(self.state.params)

  def training_forward(self, batch):
    """(parameters, a function of them: the model's forward pass with dropout on one device's
    `batch`, as its train step runs it)."""
    model = self.models.Transformer(self.model_config)
    inputs, rngs = self.inputs(batch), {'dropout': jax.random.key(0)}
    return self.params(), lambda params: model.apply({'params': params}, **inputs, rngs=rngs)

  # Our batch's keys -> flax's; a packed batch's segment ids and positions too.
  INPUT_NAMES = {'sources': 'inputs', 'targets': 'targets',
                 'source_segment_ids': 'inputs_segmentation', 'source_positions': 'inputs_position',
                 'target_segment_ids': 'targets_segmentation',
                 'target_positions': 'targets_position'}

  @classmethod
  def inputs(cls, batch):
    """Our batch under flax's names."""
    return {cls.INPUT_NAMES[name]: array for name, array in batch.items()}

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def _predict(self, params, sources, max_decode_len):
    cache = self.train_module.initialize_cache(sources, max_decode_len, self.predict_config)
    return self.train_module.predict_step(sources, params, cache, decode.EOS_ID, max_decode_len,
                                          self.predict_config, beam_size=BEAM_SIZE)

  def beam_search(self, params, sources):
    """The best of a beam search of BEAM_SIZE for each of one device's `sources`, at most
    EXTRA_LENGTH tokens longer, its cache's set-up included."""
    # Flax counts the start symbol in max_decode_len: +1 gives as many steps as ours.
    return jax.block_until_ready(self._predict(params, sources,
                                               sources.shape[1] + EXTRA_LENGTH + 1))


def _matmul_operand_dtypes(jaxpr, output_width: int) -> set:
  """'lhs x rhs' dtypes of the dot_generals in `jaxpr` and the jaxprs inside it whose outputs
  are `output_width` wide."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general' and eqn.outvars[0].aval.shape[-1] == output_width:
      found.add(' x '.join(str(v.aval.dtype) for v in eqn.invars))
    for param in eqn.params.values():
      for inner in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(inner, 'jaxpr', inner)  # a ClosedJaxpr's
        if hasattr(inner, 'eqns'):
          found |= _matmul_operand_dtypes(inner, output_width)
  return found


def described(side: Ours | Flax, batch) -> dict:
  """What a like-for-like comparison holds equal, read from `side`'s forward pass with dropout on
  one device's `batch`: its parameters' count and dtypes, the dtype its layers compute in, its
  dropout sites (each dropout module applied, by the shape it drops from and its rate), its
  attention weights' dropout rate, and the operand dtypes of its output projection (the matmuls
  as wide as the vocabulary).

  Not held equal: ours computes the attention's softmax in float32 (flax's in the layers' dtype),
  as the fused attention kernels do, and drops out the embeddings in the layers' dtype (flax's in
  float32)."""
  params, forward = side.training_forward(batch)
  sites = collections.Counter()

  def record(next_fun, args, kwargs, context):
    module = context.module
    if isinstance(module, (nn.Dropout, model.Dropout)) and context.method_name == '__call__':
      deterministic = kwargs.get('deterministic', getattr(module, 'deterministic', None))
      if module.rate > 0 and not deterministic:
        sites['x'.join(map(str, args[0].shape)) + f' at {module.rate:g}'] += 1
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jaxpr = jax.make_jaxpr(forward)(params)
  leaves = jax.tree_util.tree_leaves(params)
  return {'parameters': sum(x.size for x in leaves),
          'parameter dtypes': sorted({str(x.dtype) for x in leaves}),
          'computation dtype': jnp.dtype(side.model_config.dtype).name,
          'dropout sites': dict(sorted(sites.items())),
          'attention dropout': side.model_config.attention_dropout_rate,
          'output projection operand dtypes': sorted(_matmul_operand_dtypes(
              jaxpr.jaxpr, side.model_config.vocab_size))}


def differences(ours: Ours, theirs: Flax, batch) -> dict:
  """{what differs: (ours, flax's)} of `described`; empty for a like-for-like pair."""
  mine, flax_side = described(ours, batch), described(theirs, batch)
  return {key: (mine[key], flax_side[key]) for key in mine if mine[key] != flax_side[key]}


def define_workload_flags(name: str, variants: str, size: str = 'multi30k',
                          shape: str | None = None) -> tuple:
  """Defines the flags that vs_flax.py, profile_step.py and gpu_plan.py share, with the script's
  defaults, as it starts (so that the modules import beside each other and the other benchmarks):
  --size, --variant (`variants`: what several do), --flax_dir, --name, --output, and with a
  `shape` --shape and --packed. Returns their holders in that order."""
  holders = (
      flags.DEFINE_enum('size', size, list(CONFIG_FILES), "The model's config."),
      flags.DEFINE_multi_string('variant', [], "Space-separated key=value config overrides "
                                f"(train.py's --config.key=value without the prefix); {variants}"),
      flags.DEFINE_string('flax_dir', FLAX_DIR,
                          'Where flax examples/wmt is (fetched from the flax sdist if absent).'),
      flags.DEFINE_string('name', name, 'Results go to <name>.json and <name>.md.'),
      flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                          'Where the results go.'))
  if shape is None:
    return holders
  return (*holders, flags.DEFINE_string('shape', shape, 'Training batch, rows x length.'),
          flags.DEFINE_bool('packed', False, "Rows packed with several pairs, as train.py's "
                            'batches with packing=True, with segment ids and positions.'))
