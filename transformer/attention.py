r"""Attention heatmaps of one translation: where each layer and head looks.

  python -m transformer.attention --workdir=DIR --sentence="A man is riding a bicycle."
      [--output_dir=D] [--average_last=N] [--beam_size=B] [--alpha=A]

Translates the sentence with beam search, as eval.py does, then runs the model once over the
source and that translation with the 'intermediates' collection mutable: each attention layer sows
the softmax weights it used there (model.py), and only when asked, so training and decoding compute
nothing more. Writes D/encoder_self_attention.png, D/decoder_self_attention.png and
D/cross_attention.png (default D: DIR/attention), a row of heads per layer, axes labelled with the
SentencePiece pieces.
"""

import os
import sys

import numpy as np
from absl import app, flags
from flax import jax_utils
from matplotlib.figure import Figure  # no pyplot: no GUI backend, so it runs headless

from transformer import checkpoints, data, plots, translate
from transformer import config as config_lib
from transformer import model as model_lib

START_PIECE = '<start>'  # the decoder's first input, id 0 (padding's id) in the model

# Picture name: (title, stack, attention module, key axis label, query axis label).
KINDS = {
    'encoder_self_attention': ('encoder self-attention', 'encoder', 'self_attention',
                               'source piece', 'source piece'),
    'decoder_self_attention': ('decoder self-attention (causal)', 'decoder', 'self_attention',
                               'decoder input', 'output piece being predicted'),
    'cross_attention': ('encoder-decoder attention', 'decoder', 'cross_attention',
                        'source piece', 'output piece being predicted'),
}


def attention_weights(model_config: model_lib.TransformerConfig, params, sources, targets,
                      **packing):
  """({picture name: [batch, layers, heads, queries, keys] float32 weights}, logits) of a
  teacher-forced pass over `sources` and `targets` [batch, length] (and `Transformer`'s
  positions and segment ids of packed rows)."""
  logits, state = model_lib.Transformer(model_config).apply(
      {'params': params}, sources, targets, **packing, mutable=['intermediates'])
  sown = state['intermediates']
  weights = {}
  for name, (_, stack, module, _, _) in KINDS.items():
    layers = sorted(sown[stack], key=lambda layer: int(layer.split('_')[1]))
    weights[name] = np.stack([np.asarray(sown[stack][layer][module]['attention_weights'][0],
                                         np.float32) for layer in layers], axis=1)
  return weights, logits


def heatmaps(weights: np.ndarray, key_pieces: list[str], query_pieces: list[str], title: str,
             key_label: str, query_label: str) -> Figure:
  """One picture of one pair's weights [layers, heads, queries, keys]: layer i is row i."""
  layers, heads = weights.shape[:2]
  cell = 1.2 + 0.22 * max(len(key_pieces), len(query_pieces))  # inches: room for the labels
  figure = Figure(figsize=(cell * heads, cell * layers + 0.6), layout='constrained')
  figure.suptitle(title)
  axes = figure.subplots(layers, heads, squeeze=False)
  for layer in range(layers):
    for head in range(heads):
      ax = axes[layer, head]
      image = ax.imshow(weights[layer, head], vmin=0.0, vmax=1.0, cmap='viridis',
                        interpolation='nearest')
      ax.set_title(f'layer {layer + 1}, head {head + 1}', fontsize=9)
      ax.set_xticks(range(len(key_pieces)), key_pieces, rotation=90, fontsize=7)
      ax.set_yticks(range(len(query_pieces)), query_pieces, fontsize=7)
      if layer == layers - 1:
        ax.set_xlabel(key_label)
      if head == 0:
        ax.set_ylabel(query_label)
  figure.colorbar(image, ax=axes, shrink=0.6, label='attention weight')
  return figure


def output_ids(row: np.ndarray) -> list[int]:
  """A beam-search output row up to and with its first EOS."""
  ids = [int(i) for i in row]
  return ids[:ids.index(data.EOS_ID) + 1] if data.EOS_ID in ids else ids


def pictures(workdir: str, sentence: str, average_last: int | None, beam_size: int | None,
             alpha: float | None) -> tuple[str, dict[str, Figure]]:
  """(the translation, {picture name: figure}) of `sentence` with the run in `workdir`."""
  translator, replicated, config, _ = translate.load(workdir, average_last, beam_size, alpha)
  (row,) = translator.search(replicated, [sentence])
  source_ids = translator.vocab.encode(sentence) + [data.EOS_ID]
  target_ids = output_ids(row)
  # XLA's attention, which can hand out its weights; cuDNN's fused kernel never forms them.
  model_config = config_lib.model_config(config).replace(attention_implementation='xla')
  weights, _ = attention_weights(model_config,
                                 jax_utils.unreplicate(replicated),
                                 np.asarray([source_ids], np.int32),
                                 np.asarray([target_ids], np.int32))
  source_pieces = translator.vocab.pieces(source_ids)
  target_pieces = translator.vocab.pieces(target_ids)
  axes = {'source piece': source_pieces, 'output piece being predicted': target_pieces,
          'decoder input': [START_PIECE] + target_pieces[:-1]}
  translation = translator.vocab.decode(target_ids)
  figures = {}
  for name, (title, _, _, key_label, query_label) in KINDS.items():
    figures[name] = heatmaps(weights[name][0], axes[key_label], axes[query_label],
                             f'{title}: "{sentence}" -> "{translation}"', key_label, query_label)
  return translation, figures


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  if not FLAGS.sentence.strip():
    sys.exit('attention: --sentence is empty; give the sentence to translate')
  try:
    translation, figures = pictures(FLAGS.workdir, FLAGS.sentence, FLAGS.average_last,
                                    FLAGS.beam_size, FLAGS.alpha)
  except (config_lib.ConfigError, data.DataError, checkpoints.CheckpointError) as error:
    sys.exit(f'attention: {error}')
  output_dir = FLAGS.output_dir or os.path.join(FLAGS.workdir, 'attention')
  print(f'translation: {translation}')
  for name, figure in figures.items():
    path = os.path.join(output_dir, f'{name}.png')
    plots.save(figure, path)
    print(f'wrote {path}')


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'A train.py workdir (config.json, vocab/, checkpoints/).')
  flags.DEFINE_string('sentence', None, 'The source sentence to translate and picture.')
  flags.DEFINE_string('output_dir', None, 'Where the PNGs go (default: <workdir>/attention).')
  translate.define_decoding_flags()
  flags.adopt_module_key_flags(translate)  # --helpshort lists them
  flags.mark_flags_as_required(['workdir', 'sentence'])
  FLAGS = flags.FLAGS
  app.run(main)
