"""Pictures of train.py runs (matplotlib figures, written as PNG by `save`).

- `curves`: training curves from metrics.jsonl: loss, perplexity, learning rate and BLEU against
  the step (top row) and against hours since the run's first logged row (bottom row). Each run is
  one colour, named by its workdir; training is a solid line, validation dashed with dots, and the
  BLEU of checkpoint averages (the end of training) a circle (validation) or a star (test). A
  multilingual run's pairs are evaluated apart: the first as above, the others dotted (dash-dot)
  with hollow marks.
- `attention_figures`: attention heatmaps of one translation, where each layer and head looks.
  The sentence is translated with beam search, as eval.py does, then the model runs once over the
  source and that translation with the 'intermediates' collection mutable: each attention layer
  sows the softmax weights it used there (model.py), and only when asked, so training and decoding
  compute nothing more. One figure per kind (encoder self-attention, decoder self-attention,
  encoder-decoder attention), a row of heads per layer, axes labelled with the SentencePiece
  pieces.
"""

import io
import itertools
import json
import os

import numpy as np
from etils import epath
from flax import jax_utils
from matplotlib.figure import Figure  # no pyplot: no GUI backend, so it runs headless

from transformer import config as config_lib
from transformer import data, translate
from transformer import model as model_lib
from transformer.files import write_atomically

# (title, metric, rows it is read from: 'train' or an evaluation split, logarithmic y axis)
PANELS = (
    ('loss (label-smoothed)', 'loss', ('train', 'validation'), False),
    ('perplexity', 'perplexity', ('train', 'validation'), True),
    ('learning rate', 'learning_rate', ('train',), False),
    ('sacreBLEU', 'sacrebleu', ('validation', 'test'), False),
)

PAIR_LINES = ('--', ':', '-.')  # evaluation curves of a multilingual run's pairs, in turn


class PlotError(ValueError):
  """Unusable input; the message names the file and line."""


def read_metrics(workdir: str) -> list[dict]:
  """The rows of DIR/metrics.jsonl; a last line without its newline is still being written.

  Raises:
    PlotError: no such file, no row yet, or a line that is no metrics row (not UTF-8, not JSON,
      no integer "step", or a plotted value or "time" that is no number); the message names it.
  """
  path = os.path.join(workdir, 'metrics.jsonl')
  try:
    lines = epath.Path(path).read_bytes().splitlines(keepends=True)
  except (FileNotFoundError, NotADirectoryError):
    raise PlotError(f'{path} not found: --workdir takes a train.py workdir') from None
  except OSError as error:  # a symlink loop, no permission, a directory, an I/O error
    raise PlotError(f'{path} cannot be read ({error.strerror or error}): --workdir takes a '
                    'train.py workdir, readable by this user') from None
  if lines and not lines[-1].endswith(b'\n'):
    lines.pop()
  if not lines:
    raise PlotError(f'{path} holds no row yet: plot once the run has logged its first '
                    'log_every_steps')
  rows = []
  for number, line in enumerate(lines, 1):
    mend = f'{path}:{number} is not a metrics row'
    try:
      row = json.loads(line.decode('utf-8'))
    except UnicodeDecodeError as error:
      raise PlotError(f'{mend} (not UTF-8, byte {error.start}): delete or mend that line') from None
    except json.JSONDecodeError as error:
      raise PlotError(f'{path}:{number} is not JSON ({error.msg}): delete or mend that '
                      'line') from None
    if not isinstance(row, dict) or not isinstance(row.get('step'), int):
      raise PlotError(f'{mend} (a JSON object with an integer "step"): delete or mend that line')
    for key in ('time', *(metric for _, metric, _, _ in PANELS)):
      if key in row and (isinstance(row[key], bool) or not isinstance(row[key], (int, float))):
        raise PlotError(f'{mend}: its "{key}" is {row[key]!r}, not a number; delete or mend that '
                        'line')
    rows.append(row)
  return rows


def series(rows: list[dict], split: str, metric: str, averaged: bool = False,
           pair: str | None = None) -> list[tuple[int, float, float | None]]:
  """(step, value, seconds since the first row or None) of `metric` in `split`'s rows (those of
  one language `pair` of a multilingual run), in step order: those of the current parameters, or
  (`averaged`) of checkpoint averages, as at the end of training. A resumed run logs again from
  its checkpoint's step: later rows replace earlier ones."""
  start = next((row['time'] for row in rows if 'time' in row), None)
  points = {}
  for row in rows:
    if (row.get('split', 'train') == split and row.get('pair') == pair and metric in row
        and ('checkpoint_steps' in row) == averaged):
      for step in [s for s in points if s >= row['step']]:
        del points[step]
      seconds = row['time'] - start if 'time' in row and start is not None else None
      points[row['step']] = (row['step'], row[metric], seconds)
  return sorted(points.values())


def curves(runs: dict[str, list[dict]]) -> Figure:
  """The figure of `runs`: {name: metrics rows}."""
  figure = Figure(figsize=(4 * len(PANELS), 6.5), layout='constrained')
  axes = figure.subplots(2, len(PANELS))
  colours = [f'C{i % 10}' for i in range(len(runs))]
  for column, (title, metric, splits, log_scale) in enumerate(PANELS):
    for row, x_label in enumerate(('step', 'hours')):
      ax = axes[row, column]
      for colour, (name, rows) in zip(colours, runs.items()):
        pairs = sorted({row['pair'] for row in rows if 'pair' in row}) or [None]
        for split, (number, pair), averaged in itertools.product(splits, enumerate(pairs),
                                                                  (False, True)):
          points = series(rows, split, metric, averaged, None if split == 'train' else pair)
          if row == 1:
            points = [p for p in points if p[2] is not None]
          if not points or split == 'train' and number:
            continue
          xs = [p[0] if row == 0 else p[2] / 3600 for p in points]
          if averaged:  # checkpoint averages: points, not a curve
            style = dict(linestyle='none', marker='*' if split == 'test' else 'o', markersize=8)
          else:
            style = dict(linestyle='-') if split == 'train' else dict(
                linestyle=PAIR_LINES[number % len(PAIR_LINES)], marker='.')
          if number:  # a multilingual run's other pairs: hollow marks
            style['fillstyle'] = 'none'
          label = (f'{name} ({split}{f" {pair}" if pair and split != "train" else ""}'
                   f'{", averaged" if averaged else ""})')
          ax.plot(xs, [p[1] for p in points], color=colour, label=label, **style)
      ax.set_title(f'{title} ({", ".join(splits)})' if len(splits) == 1 else title)
      ax.set_xlabel(x_label)
      if log_scale:
        ax.set_yscale('log')
      ax.grid(alpha=0.3)
  handles, labels = {}, []
  for ax in axes.flat:  # one legend for the figure: each (run, split) once
    for handle, label in zip(*ax.get_legend_handles_labels()):
      if label not in handles:
        handles[label] = handle
        labels.append(label)
  if labels:
    figure.legend([handles[label] for label in labels], labels, loc='outside lower center',
                  ncols=min(len(labels), 4))
  return figure


def run_names(workdirs: list[str]) -> list[str]:
  """Each workdir's last path component, or the whole path where two runs share it."""
  names = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  return [n if names.count(n) == 1 else os.path.normpath(w) for n, w in zip(names, workdirs)]


def image_format(path: str) -> str:
  """The picture format `path`'s extension names (png, pdf, svg, ...; png without one).

  Raises:
    PlotError: matplotlib writes no such format.
  """
  extension = os.path.splitext(path)[1][1:].lower() or 'png'
  supported = Figure().canvas.get_supported_filetypes()
  if extension not in supported:
    raise PlotError(f'{path}: matplotlib writes no .{extension} picture; end the name in one of '
                    f'{", ".join("." + name for name in sorted(supported))}')
  return extension


def save(figure: Figure, path: str):
  """Writes the figure in the format of `path`'s extension (`image_format`), atomically."""
  buffer = io.BytesIO()
  figure.savefig(buffer, format=image_format(path), dpi=80)
  write_atomically(path, buffer.getvalue())


# Attention heatmaps.

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


def attention_heatmaps(weights: np.ndarray, key_pieces: list[str], query_pieces: list[str], title: str,
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


def attention_figures(workdir: str, sentence: str,
                      **decoding) -> tuple[str, dict[str, Figure]]:
  """(the translation, {picture name: figure}) of `sentence` with the run in `workdir`, loaded
  by `translate.load(workdir, **decoding)`."""
  translator, replicated, config, _ = translate.load(workdir, **decoding)
  ((outputs, _, _),) = translator.search(replicated, [sentence])
  (source_ids,) = translator.encode([sentence])  # as the search took it: cut to max_length
  sentence = translator.vocab.decode(source_ids)
  target_ids = output_ids(outputs[0])
  # XLA's attention, which can hand out its weights; cuDNN's fused kernel never forms them.
  model_config = config_lib.model_config(config)
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
    figures[name] = attention_heatmaps(weights[name][0], axes[key_label], axes[query_label],
                             f'{title}: "{sentence}" -> "{translation}"', key_label, query_label)
  return translation, figures
