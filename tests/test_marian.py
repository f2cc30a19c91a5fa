"""Our model against Hugging Face's Marian (transformers on PyTorch) and CTranslate2, computed by
their own code: the layout mapping (transformer/marian.py) both ways, and export.py's directories
of a trained run."""

import itertools
import json
import os

import ctranslate2
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax.traverse_util import flatten_dict, unflatten_dict

from conftest import built_once, error_line, run_script, train_in_process
from transformer import config as config_lib
from transformer import stored_config
from transformer import data, marian, sampling, translate
from transformer.model import Transformer, TransformerConfig, sinusoidal_encoding

MODEL = dict(d_model=16, d_ff=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
             dropout_rate=0.1, attention_dropout_rate=0.0, relu_dropout_rate=0.0,
             share_embeddings=True, tie_output_embedding=True, positional_encoding='sinusoidal',
             max_positions=512, layer_norm='post', layer_norm_epsilon=1e-6, activation='relu',
             attention_bias=False, output_bias=False, scale_embedding=True)
VOCAB = 40
EXTRA = 50  # configs/tiny.py's decode_extra_length


def shapes_of(config: TransformerConfig) -> dict:
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  return flatten_dict(jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens,
                                     tokens)['params'])


def random_params(config: TransformerConfig, seed: int = 0) -> dict:
  """Parameters with every value random, LayerNorms and biases included: none of them may be
  mapped to the wrong feature unseen."""
  rng = np.random.default_rng(seed)
  return {path: rng.normal(0, 0.3, shape.shape).astype(np.float32) + (
      1.0 if path[-1] == 'scale' else 0.0) for path, shape in shapes_of(config).items()}


def hf_logits(model, sources, decoder_inputs) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(sources),
                 attention_mask=torch.from_numpy((sources != model.config.pad_token_id) * 1),
                 decoder_input_ids=torch.from_numpy(decoder_inputs)).logits.numpy()


def set_hf_epsilon(model, epsilon: float):
  for module in model.modules():
    if isinstance(module, torch.nn.LayerNorm):
      module.eps = epsilon


def test_marian_positions_are_ours_in_residual_order():
  """Marian's position table (sines, then cosines) is ours (interleaved) with its features in
  `residual_order`."""
  table = transformers.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding(300, 16)
  table._init_weight()  # pylint: disable=protected-access
  ours = np.asarray(sinusoidal_encoding(jnp.arange(300), 16))
  # Up to the rounding of our float32 angles (theirs are float64): 4e-6 by position 300.
  np.testing.assert_allclose(table.weight.detach().numpy(), ours[:, marian.residual_order(16)],
                             atol=1e-5)
  assert not np.allclose(table.weight.detach().numpy(), ours, atol=0.1)


@pytest.mark.slow
@pytest.mark.parametrize('variant', [
    {},
    {'share_embeddings': False},
    {'tie_output_embedding': False},
    {'activation': 'swish', 'attention_bias': True, 'output_bias': True},
    {'activation': 'gelu', 'scale_embedding': False},
])
def test_marian_layout_computes_what_ours_computes(variant, float32_matmuls):
  """Every weight exported to Marian's names and order gives transformers' MarianMTModel our
  logits; the mapping back gives our parameters exactly."""
  model = {**MODEL, **variant}
  config = TransformerConfig(vocab_size=VOCAB, **model)
  params = random_params(config)
  full = shapes_of(config.replace(attention_bias=True, output_bias=True))
  tensors = marian.to_marian(params, model, full)
  hf = transformers.MarianMTModel(transformers.MarianConfig(**marian.hf_config(model, VOCAB, 64)))
  hf.load_state_dict({name: torch.from_numpy(value) for name, value in tensors.items()},
                     strict=False)
  hf.eval()
  rng = np.random.default_rng(1)
  sources = rng.integers(3, VOCAB, (3, 9))
  sources[:, -1], sources[0, 5], sources[0, 6:] = 1, 1, 0  # one padded row
  targets = rng.integers(3, VOCAB, (3, 7))
  targets[:, -1] = 1
  ours = np.asarray(Transformer(config).apply({'params': unflatten_dict(params)}, sources,
                                              targets))
  decoder_inputs = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  set_hf_epsilon(hf, model['layer_norm_epsilon'])
  np.testing.assert_allclose(hf_logits(hf, sources, decoder_inputs), ours, atol=1e-4, rtol=0)
  set_hf_epsilon(hf, marian.LAYER_NORM_EPSILON)  # as transformers runs it
  np.testing.assert_allclose(hf_logits(hf, sources, decoder_inputs), ours, atol=1e-3, rtol=0)

  back = marian.from_marian(tensors, model, shapes_of(config), np.arange(VOCAB))
  assert set(back) == set(params)
  for path, value in params.items():
    np.testing.assert_array_equal(back[path], value, err_msg=str(path))


@pytest.mark.slow
def test_an_opus_mt_marian_imports_with_its_logits_and_greedy_translations(float32_matmuls):
  """A randomly initialised MarianMTModel in OPUS-MT's layout (swish, attention and logits
  biases, scaled embeddings, EOS 0, unk 1, pad last as the start symbol) gives, mapped to our
  model and token order, HF's logits and HF's greedy translations."""
  hf_config = transformers.MarianConfig(
      vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32,
      decoder_ffn_dim=32, encoder_attention_heads=4, decoder_attention_heads=4,
      activation_function='swish', scale_embedding=True, pad_token_id=VOCAB - 1,
      decoder_start_token_id=VOCAB - 1, eos_token_id=0, forced_eos_token_id=0,
      max_position_embeddings=128)
  torch.manual_seed(0)
  hf = transformers.MarianMTModel(hf_config).eval()
  with torch.no_grad():  # every bias and LayerNorm non-trivial, as in a trained model
    for name, tensor in hf.named_parameters():
      if 'embed_positions' not in name:  # fixed sinusoids, never saved
        tensor.add_(torch.randn_like(tensor) * 0.3)
    hf.final_logits_bias.add_(torch.randn_like(hf.final_logits_bias))
  tensors = {name: tensor.detach().numpy() for name, tensor in hf.state_dict().items()}
  vocab = {f'piece{i}': i for i in range(VOCAB)}
  vocab.update({marian.EOS: 0, marian.UNK: 1, marian.PAD: VOCAB - 1})
  hf_dict = hf_config.to_dict()
  order = marian.token_order(hf_dict, vocab)
  np.testing.assert_array_equal(order[:4], [VOCAB - 1, 0, 1, 2])
  model = {**MODEL, 'max_positions': 512, **marian.model_keys(hf_dict)}
  config = TransformerConfig(vocab_size=VOCAB, **model)
  params = unflatten_dict(marian.from_marian(tensors, model, shapes_of(config), order))
  ours_of = np.argsort(order)  # HF id -> our id

  rng = np.random.default_rng(2)
  sources = rng.integers(2, VOCAB - 1, (4, 8))
  sources[:, -1], sources[1, 4], sources[1, 5:] = 0, 0, VOCAB - 1  # EOS; a padded row
  targets = rng.integers(2, VOCAB - 1, (4, 6))
  targets[:, -1] = 0
  decoder_inputs = np.concatenate([np.full((4, 1), VOCAB - 1), targets[:, :-1]], axis=1)
  theirs = hf_logits(hf, sources, decoder_inputs)
  ours = np.asarray(Transformer(config).apply({'params': params}, ours_of[sources],
                                              ours_of[targets]))
  np.testing.assert_allclose(ours, theirs[..., order], atol=1e-4, rtol=0)

  # Greedy to our limit, each sentence's length + 10: forced EOS there, never the pad id.
  greedy = np.asarray(sampling.greedy_search(config, params, jnp.asarray(ours_of[sources]), 10))
  for source, ours_row in zip(sources, greedy):
    source = source[source != VOCAB - 1][None]
    their_row = hf.generate(input_ids=torch.from_numpy(source), num_beams=1, do_sample=False,
                            max_length=source.shape[1] + 10 + 1,
                            bad_words_ids=[[VOCAB - 1]]).numpy()[0, 1:]
    their_ids = list(ours_of[their_row[their_row != VOCAB - 1]])
    assert their_ids[-1] == 1 and list(ours_row[:len(their_ids)]) == their_ids
    assert ours_row[len(their_ids):].sum() == 0


def test_a_marian_config_this_model_cannot_represent_is_refused_naming_the_field():
  base = transformers.MarianConfig(encoder_ffn_dim=64, decoder_ffn_dim=64).to_dict()
  for field, value, named in [('decoder_ffn_dim', 32, '"decoder_ffn_dim"=32'),
                              ('activation_function', 'gelu_new', '"activation_function"'),
                              ('decoder_vocab_size', 7, '"decoder_vocab_size"=7'),
                              ('encoder_layerdrop', 0.1, '"encoder_layerdrop"=0.1'),
                              ('model_type', 'bart', '"model_type"')]:
    with pytest.raises(marian.MarianError, match=named):
      marian.model_keys({**base, field: value})
  with pytest.raises(marian.MarianError, match='decoder_start_token_id'):
    marian.token_order({**base, 'decoder_start_token_id': 5}, {marian.UNK: 1})


def by_length(ids: list[list[int]]):
  """Sentence indices grouped by source length (EOS included): one limit per call there, as ours
  per sentence."""
  order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
  for length, group in itertools.groupby(order, key=lambda i: len(ids[i])):
    yield length, list(group)


@pytest.fixture(scope='module')
def exported(tiny_run, tmp_path_factory) -> dict:
  """The tiny run exported by export.py in each format: format -> directory."""
  formats = {'transformers': [], 'ctranslate2': ['--format=ctranslate2'],
             'int8': ['--format=ctranslate2', '--quantization=int8']}

  def export(path):
    for name, flags in formats.items():
      result = run_script('export.py', f'--workdir={tiny_run}', f'--output_dir={path}/{name}',
                          *flags)
      assert result.returncode == 0, result.stderr[-3000:]

  path = built_once(tmp_path_factory, 'exported', export)
  return {name: os.path.join(path, name) for name in formats}


@pytest.fixture(scope='module')
def test_split(tiny_run):
  """(the run's config, its vocabulary, test sources, their ids with EOS)."""
  config = stored_config.load_workdir_config(tiny_run)
  vocab = data.load_vocabulary(config, tiny_run)
  sources, _ = data.split_texts(config, 'test')
  return config, vocab, sources, [vocab.encode(s) + [1] for s in sources]


@pytest.mark.slow
def test_the_exported_run_computes_in_transformers_what_it_computes_here(tiny_run, exported,
                                                                        test_split,
                                                                        float32_matmuls):
  """MarianTokenizer, MarianMTModel and pipeline('translation') load the directory alone; the
  tokenizer gives our ids, the model our logits (up to its LayerNorm epsilon) and our greedy and
  alpha-0 beam translations of 200 sentences."""
  config, vocab, sources, ids = test_split
  assert len(sources) >= 200
  directory = exported['transformers']
  assert sorted(os.listdir(directory)) == [
      'README.md', 'config.json', 'generation_config.json', 'model.safetensors', 'source.spm',
      'target.spm', 'tokenizer_config.json', 'vocab.json']
  tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
  hf = transformers.MarianMTModel.from_pretrained(directory).eval()
  assert [tokenizer(s)['input_ids'] for s in sources] == ids

  batch = tokenizer(sources[:16], text_target=sources[16:32], return_tensors='pt', padding=True)
  targets = batch['labels'].numpy()
  with torch.no_grad():
    theirs = hf(input_ids=batch['input_ids'], attention_mask=batch['attention_mask'],
                labels=batch['labels']).logits.numpy()
  translator, params, _, _ = translate.load(tiny_run)
  one = jax.tree_util.tree_map(lambda x: x[0], params)
  model = config_lib.model_config(config)
  real = targets > 0
  for epsilon, tolerance in ((model.layer_norm_epsilon, 1e-4),  # ours as trained: 1.8e-5 seen
                             (marian.LAYER_NORM_EPSILON, 1e-5)):  # as HF runs it: 2.9e-6 seen
    ours = Transformer(model.replace(layer_norm_epsilon=epsilon)).apply(
        {'params': one}, batch['input_ids'].numpy(), targets)
    assert np.abs(theirs - np.asarray(ours))[real].max() < tolerance

  for beam_size in (1, 4):
    hypotheses = [None] * len(sources)
    for length, group in by_length(ids):
      inputs = tokenizer([sources[i] for i in group], return_tensors='pt', padding=True)
      outputs = hf.generate(**inputs, num_beams=beam_size, length_penalty=0.0,
                            max_length=length + EXTRA + 1).numpy()
      for i, output in zip(group, outputs):
        output = list(output[1:])  # after the start symbol, up to EOS
        hypotheses[i] = output[:output.index(1) + 1]
    assert_same_or_at_the_limit(our_outputs(tiny_run, sources, beam_size), hypotheses, ids,
                                beam_size)

  pipe = transformers.pipeline('translation', model=directory)
  generation = json.load(open(os.path.join(directory, 'generation_config.json')))
  assert (generation['num_beams'], generation['length_penalty']) == (config.beam_size,
                                                                     config.alpha)
  outputs = hf.generate(**tokenizer(sources[:8], return_tensors='pt', padding=True))
  assert [row['translation_text'] for row in pipe(sources[:8])] == tokenizer.batch_decode(
      outputs, skip_special_tokens=True)


def our_outputs(workdir: str, sources: list[str], beam_size: int) -> list[list[int]]:
  """Our search's output ids of each sentence, EOS included, with length penalty alpha 0."""
  translator, params, _, _ = translate.load(workdir, beam_size=beam_size, alpha=0.0)
  return [list(row[:list(row).index(1) + 1]) for (row, *_), _, _ in translator.search(params, sources)]


def assert_same_or_at_the_limit(ours, theirs, ids, beam_size):
  """Greedy: the same outputs. Beam search: the same outputs but where one reaches the length
  limit, which there ends with an EOS scored as certain (transformers' forced EOS) or with no EOS
  at all (CTranslate2), and here with its probability."""
  differ = [i for i in range(len(ours)) if ours[i] != theirs[i]]
  if beam_size == 1:
    assert not differ
  at_limit = [i for i in differ if max(len(ours[i]), len(theirs[i]) + 1) >= len(ids[i]) + EXTRA]
  assert differ == at_limit and len(differ) < len(ours) // 10, (beam_size, differ)


def ctranslate2_outputs(directory, vocab, ids, beam_size):
  """CTranslate2's output ids (EOS added) of each sentence, length penalty alpha 0."""
  translator = ctranslate2.Translator(directory, device='cpu', intra_threads=1)
  hypotheses = [None] * len(ids)
  for length, group in by_length(ids):
    # Ours ends at the limit with EOS, which CTranslate2 does not add: one token less.
    results = translator.translate_batch([vocab.pieces(ids[i]) for i in group],
                                         beam_size=beam_size, length_penalty=0.0,
                                         max_decoding_length=length + EXTRA - 1,
                                         min_decoding_length=0)  # ours may end at once
    for i, result in zip(group, results):
      hypotheses[i] = vocab.piece_ids(result.hypotheses[0]) + [1]
  return hypotheses


@pytest.mark.slow
def test_the_ctranslate2_export_translates_as_ours(tiny_run, exported, test_split):
  """float32: our greedy and alpha-0 beam translations of 200 sentences; int8: weights of a
  quarter of the bytes, which translate."""
  _, vocab, sources, ids = test_split
  for beam_size in (1, 4):
    assert_same_or_at_the_limit(
        our_outputs(tiny_run, sources, beam_size),
        ctranslate2_outputs(exported['ctranslate2'], vocab, ids, beam_size), ids, beam_size)
  sizes = {name: os.path.getsize(os.path.join(exported[name], 'model.bin'))
           for name in ('ctranslate2', 'int8')}
  assert sizes['int8'] < 0.6 * sizes['ctranslate2']
  int8 = ctranslate2_outputs(exported['int8'], vocab, ids, 1)
  assert sum(len(output) > 1 for output in int8) > 150
  config = json.load(open(os.path.join(exported['ctranslate2'], 'config.json')))
  assert config['layer_norm_epsilon'] == 1e-6


@pytest.mark.slow
def test_export_refuses_what_marian_cannot_hold_before_any_work(tiny_run, tmp_path):
  stored = json.load(open(os.path.join(tiny_run, 'config.json')))
  for key, value in (('layer_norm', 'pre'), ('positional_encoding', 'learned')):
    workdir = tmp_path / key
    workdir.mkdir()
    (workdir / 'config.json').write_text(json.dumps(
        {**stored, 'model': {**stored['model'], key: value}}))
    result = run_script('export.py', f'--workdir={workdir}', f'--output_dir={tmp_path}/out')
    assert f'config.model.{key}={value!r}' in error_line(result)
    assert not (tmp_path / 'out').exists()
  full = tmp_path / 'full'
  full.mkdir()
  (full / 'x').write_text('')
  result = run_script('export.py', f'--workdir={tiny_run}', f'--output_dir={full}')
  assert f'--output_dir={full} is not empty' in error_line(result)
  result = run_script('export.py', f'--workdir={tiny_run}', f'--output_dir={tmp_path}/q',
                      '--quantization=int8')
  assert '--quantization is for --format=ctranslate2' in error_line(result)
  result = run_script('export.py', f'--workdir={tiny_run}', f'--output_dir={tmp_path}/avg',
                      '--average_last=9')  # 3 checkpoints kept
  assert 'export.py: ' in error_line(result) and not (tmp_path / 'avg').exists()
  result = run_script('export.py', f'--workdir={tiny_run}', f'--output_dir={full}/x/out')
  assert f'--output_dir: {full}/x/out cannot be made a directory' in error_line(result)
  for format_name in ('transformers', 'ctranslate2'):  # a full disk: one line, nothing left
    result = run_script('export.py', f'--workdir={tiny_run}', f'--output_dir={tmp_path}/big',
                        f'--format={format_name}', max_file_bytes=50_000)
    assert error_line(result) == f'export.py: {tmp_path}/big could not be written (File too large)'
    assert sorted(os.listdir(tmp_path)) == ['full', 'layer_norm', 'positional_encoding']


def opus_mt_directory(path, tiny_texts) -> str:
  """A Hugging Face Marian directory in OPUS-MT's layout, written by transformers itself: its own
  source and target SentencePiece models (trained on the tiny run's text) mapped through one
  vocab.json, EOS 0, unk 1, pad last as the decoder's start, swish, scaled embeddings, and random
  weights, attention and logits biases included."""
  import io  # pylint: disable=import-outside-toplevel
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel

  models = []
  for texts in tiny_texts:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model,
                                   vocab_size=40, model_type='unigram', minloglevel=2)
    models.append(model.getvalue())
  pieces = []
  for model in models:
    processor = spm.SentencePieceProcessor(model_proto=model)
    pieces += [processor.id_to_piece(i) for i in range(processor.get_piece_size())
               if not processor.is_control(i) and not processor.is_unknown(i)]
  pieces = [marian.EOS, marian.UNK] + sorted(set(pieces)) + [marian.PAD]
  size = len(pieces)
  config = transformers.MarianConfig(
      vocab_size=size, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32,
      decoder_ffn_dim=32, encoder_attention_heads=4, decoder_attention_heads=4,
      activation_function='swish', scale_embedding=True, pad_token_id=size - 1,
      decoder_start_token_id=size - 1, eos_token_id=0, forced_eos_token_id=0,
      bad_words_ids=[[size - 1]], max_position_embeddings=256)
  torch.manual_seed(0)
  model = transformers.MarianMTModel(config)
  with torch.no_grad():
    for name, tensor in model.named_parameters():
      if 'embed_positions' not in name:
        tensor.add_(torch.randn_like(tensor) * 0.3)
    model.final_logits_bias.add_(torch.randn_like(model.final_logits_bias))
  model.save_pretrained(path)
  for name, content in zip(('source.spm', 'target.spm'), models):
    (path / name).write_bytes(content)
  (path / 'vocab.json').write_text(json.dumps({piece: i for i, piece in enumerate(pieces)}))
  (path / 'tokenizer_config.json').write_text(json.dumps({'source_lang': 'en',
                                                          'target_lang': 'de'}))
  assert (path / 'model.safetensors').exists()
  return str(path)


@pytest.mark.slow
def test_a_run_starts_from_an_opus_mt_directory_with_its_model_vocabulary_and_weights(
    tiny_run, tmp_path, float32_matmuls):
  """train.py --config.init_from=DIR takes the model, the vocabulary and the weights of an
  OPUS-MT-layout directory: before training our logits are transformers' (in our token order);
  a run at learning rate 0 then translates with translate.py as transformers' greedy search."""
  from transformer import train_step  # pylint: disable=import-outside-toplevel
  from configs import tiny  # pylint: disable=import-outside-toplevel

  tiny_config = stored_config.load_workdir_config(tiny_run)
  directory = opus_mt_directory(tmp_path / 'opus', data.split_texts(tiny_config, 'train'))
  hf = transformers.MarianMTModel.from_pretrained(directory).eval()
  tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
  config = tiny.get_config()
  config.init_from = directory
  marian.with_imported_model(config)
  assert (config.vocab_size, config.model.activation, config.model.layer_norm_epsilon) == (
      hf.config.vocab_size, 'swish', 1e-5)
  params = train_step.initial_state(config).params

  sources, references = data.split_texts(tiny_config, 'test')
  vocab = data.vocabulary.marian_vocabulary(directory)
  ours_of = np.argsort(marian.token_order(hf.config.to_dict(),
                                          json.load(open(f'{directory}/vocab.json'))))
  assert vocab.encode_batch(sources, add_eos=True) == [
      list(ours_of[tokenizer(s)['input_ids']]) for s in sources]
  batch = tokenizer(sources[:8], text_target=references[:8], return_tensors='pt', padding=True)
  labels = batch['labels'].numpy()
  with torch.no_grad():
    theirs = hf(input_ids=batch['input_ids'], attention_mask=batch['attention_mask'],
                labels=batch['labels']).logits.numpy()
  ours = Transformer(config_lib.model_config(config)).apply(
      {'params': params}, ours_of[batch['input_ids'].numpy()], ours_of[labels])
  real = labels != hf.config.pad_token_id
  assert np.abs(np.asarray(ours) - theirs[..., marian.token_order(
      hf.config.to_dict(), tokenizer.get_vocab())])[real].max() < 1e-4

  workdir = str(tmp_path / 'run')
  train_in_process(workdir, init_from=directory, lr_scale=0.0, num_train_steps=2,
                   checkpoint_every_steps=0, average_last=1, eval_every_steps=0,
                   final_bleu_splits='')
  result = run_script('translate.py', f'--workdir={workdir}', '--beam_size=1',
                      stdin=''.join(s + '\n' for s in sources[:40]))
  assert result.returncode == 0, result.stderr[-3000:]
  ids = [tokenizer(s)['input_ids'] for s in sources[:40]]
  expected = [None] * 40
  for length, group in by_length(ids):
    inputs = tokenizer([sources[i] for i in group], return_tensors='pt', padding=True)
    outputs = hf.generate(**inputs, num_beams=1, max_length=length + EXTRA + 1)
    for i, text in zip(group, tokenizer.batch_decode(outputs, skip_special_tokens=True)):
      expected[i] = text
  assert result.stdout.splitlines() == expected
  # The directory itself as translate.py's --workdir: the same translations.
  result = run_script('translate.py', f'--workdir={directory}', '--beam_size=1',
                      stdin=''.join(s + '\n' for s in sources[:40]))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == expected


@pytest.mark.slow
def test_eval_py_scores_a_marian_directory_with_its_generation_settings(tiny_run, exported,
                                                                        test_split, tmp_path):
  """eval.py --workdir=EXPORT translates with the exported weights at transformers' LayerNorm
  epsilon, the beam size and alpha of generation_config.json, and the model card's target
  language; what a Marian directory cannot do is refused in one line."""
  config, vocab, sources, _ = test_split
  _, references = data.split_texts(config, 'test')
  for name, lines in (('source', sources), ('reference', references)):
    (tmp_path / f'{name}.txt').write_text(''.join(line + '\n' for line in lines))
  directory = exported['transformers']
  files = [f'--source_file={tmp_path}/source.txt', f'--reference_file={tmp_path}/reference.txt']
  result = run_script('eval.py', f'--workdir={directory}', *files, f'--output_dir={tmp_path}/eval')
  assert result.returncode == 0, result.stderr[-3000:]
  scores = json.load(open(tmp_path / 'eval' / 'scores.json'))
  assert (scores['checkpoint_steps'], scores['beam_size'], scores['alpha']) == (
      None, config.beam_size, config.alpha)

  _, params, _, _ = translate.load(tiny_run)
  at_their_epsilon = config.copy_and_resolve_references()
  at_their_epsilon.model.layer_norm_epsilon = marian.LAYER_NORM_EPSILON
  ours = translate.Translator(at_their_epsilon, vocab, config.beam_size, config.alpha)
  assert (tmp_path / 'eval' / 'hypotheses.txt').read_text().splitlines() == ours.translate(
      params, sources)

  bare = tmp_path / 'bare'
  bare.mkdir()
  for file in os.listdir(directory):
    if file != 'README.md':  # no model card: no languages
      (bare / file).write_bytes(open(os.path.join(directory, file), 'rb').read())
  for script, flags, message in (
      ('eval.py', [f'--workdir={directory}'], 'names no dataset: give --source_file and '
       '--reference_file'),
      ('eval.py', [f'--workdir={bare}', *files], 'README.md names no language pair'),
      ('average_checkpoints.py', [f'--workdir={directory}'], 'is a Hugging Face Marian directory, '
       'not a train.py workdir')):
    line = error_line(run_script(script, *flags, f'--output_dir={tmp_path}/{script}'))
    assert line.startswith(f'{script}: ') and message in line, line
    assert not (tmp_path / script).exists()


@pytest.mark.slow
def test_export_then_import_then_export_gives_the_same_files(tiny_run, exported, tmp_path):
  """A run started from an export of the tiny run, at learning rate 0, exports to the same bytes
  but for the model card, which names its own command."""

  first = exported['transformers']
  workdir = str(tmp_path / 'run')
  train_in_process(workdir, init_from=first, lr_scale=0.0, num_train_steps=2,
                   checkpoint_every_steps=0, average_last=1, eval_every_steps=0,
                   final_bleu_splits='')
  again = str(tmp_path / 'again')
  result = run_script('export.py', f'--workdir={workdir}', f'--output_dir={again}')
  assert result.returncode == 0, result.stderr[-3000:]
  # The first export averaged the run's last two checkpoints: the same weights here.
  names = sorted(os.listdir(first))
  assert sorted(os.listdir(again)) == names
  for name in names:
    if name != 'README.md':
      assert open(f'{first}/{name}', 'rb').read() == open(f'{again}/{name}', 'rb').read(), name


@pytest.mark.slow
def test_a_marian_directory_this_model_cannot_take_stops_train_py_in_one_line(exported, tmp_path):
  source = exported['transformers']
  for name, change, named in [
      ('ffn', {'decoder_ffn_dim': 7}, '"decoder_ffn_dim"=7'),
      ('layerdrop', {'encoder_layerdrop': 0.1}, '"encoder_layerdrop"=0.1'),
      ('bin', None, 'it has pytorch_model.bin: write model.safetensors with transformers')]:
    directory = tmp_path / name
    directory.mkdir()
    for file in os.listdir(source):
      (directory / file).write_bytes(open(os.path.join(source, file), 'rb').read())
    if change is None:
      (directory / 'model.safetensors').rename(directory / 'pytorch_model.bin')
    else:
      config = json.loads((directory / 'config.json').read_text())
      (directory / 'config.json').write_text(json.dumps({**config, **change}))
    workdir = tmp_path / f'run_{name}'
    result = run_script('train.py', '--config=configs/tiny.py', f'--workdir={workdir}',
                        f'--config.init_from={directory}')
    line = error_line(result)
    assert line.startswith(f"train.py: config.init_from='{directory}'") and named in line, line
    assert not workdir.exists() or not os.listdir(workdir)
