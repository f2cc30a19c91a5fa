r"""One trained run translated here, by transformers' generate and by CTranslate2 (float32 and
int8), on the same sentences with the same beam size: sentences per second and sacreBLEU of each.

  python -m benchmarks.interop_speed --workdir=runs/multi30k [--split=test] [--beam_size=4]
      [--threads=2] [--label=NAME]

The run is exported as export.py does (transformer/export.py) to a temporary directory. Each
engine decodes with its own length penalty at the run's alpha (ours GNMT's ((5 + length) / 6)^alpha,
theirs length^alpha) and its own length limit (ours per sentence, theirs per batch: the run's
max_length + decode_extra_length), on --threads CPU threads, after a warm-up on the first batch;
then all of them again with alpha 0, where the penalties agree, for the share of translations
identical to ours. Adds a row under --label to benchmarks/results/interop_speed.{json,md}.
"""

import os
import tempfile
import time

from absl import app, flags

_WORKDIR = flags.DEFINE_string('workdir', None, 'A trained train.py workdir.')
_SPLIT = flags.DEFINE_string('split', 'test', 'The run dataset\'s split to translate.')
_BEAM_SIZE = flags.DEFINE_integer('beam_size', 4, 'Beam size for every engine.')
_THREADS = flags.DEFINE_integer('threads', 2, 'CPU threads for every engine.')
_BATCH = flags.DEFINE_integer('batch_size', 32, 'Sentences per call of transformers and '
                              'CTranslate2, sorted by length (ours batches by its own rule).')
_LABEL = flags.DEFINE_string('label', 'current', 'Name of this measurement in the results.')
_OUTPUT = flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), 'results'),
                              'Where interop_speed.json and interop_speed.md go.')
flags.mark_flag_as_required('workdir')

ENGINES = ('ours', 'transformers', 'ctranslate2 float32', 'ctranslate2 int8')


def batches(sentences: list, size: int):
  """Index lists of `size` sentences of similar length, longest first."""
  order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
  return [order[start:start + size] for start in range(0, len(order), size)]


def engines(workdir: str, directory: str, beam_size: int, threads: int, batch_size: int):
  """{engine: translate(sentences, alpha) -> (translations, seconds after the warm-up)}."""
  import ctranslate2  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from transformer import checkpoints, data, export, stored_config, translate  # pylint: disable=import-outside-toplevel

  config = stored_config.load_workdir_config(workdir)
  vocab = data.load_vocabulary(config, workdir)
  params, _ = checkpoints.load_params(workdir, config)
  for name, format_name in (('transformers', 'transformers'), ('float32', 'ctranslate2'),
                            ('int8', 'ctranslate2')):
    os.makedirs(os.path.join(directory, name))
    export.write(params, config, vocab, os.path.join(directory, name), format_name,
                 quantization='int8' if name == 'int8' else 'float32')
  hf_dir = os.path.join(directory, 'transformers')
  torch.set_num_threads(threads)
  tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
  model = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
  max_length = config.max_length + config.decode_extra_length

  def timed(translate_batch, sentences):
    out = [None] * len(sentences)
    groups = batches(sentences, batch_size)
    translate_batch([sentences[i] for i in groups[0]])  # warm-up
    began = time.perf_counter()
    for group in groups:
      for i, text in zip(group, translate_batch([sentences[i] for i in group])):
        out[i] = text
    return out, time.perf_counter() - began

  def ours(sentences, alpha):
    translator, replicated, _, _ = translate.load(workdir, beam_size=beam_size, alpha=alpha)
    began = time.perf_counter()
    out = translator.translate(replicated, sentences)
    return out, time.perf_counter() - began - translator.compile_secs

  def hf(sentences, alpha):
    def translate_batch(texts):
      with torch.no_grad():
        outputs = model.generate(**tokenizer(texts, return_tensors='pt', padding=True),
                                 num_beams=beam_size, length_penalty=alpha,
                                 max_length=max_length + 1)
      return tokenizer.batch_decode(outputs, skip_special_tokens=True)
    return timed(translate_batch, sentences)

  def ct2(quantization):
    translator = ctranslate2.Translator(os.path.join(directory, quantization), device='cpu',
                                        inter_threads=1, intra_threads=threads)

    def run(sentences, alpha):
      def translate_batch(texts):
        pieces = [vocab.pieces(ids) for ids in vocab.encode_batch(texts, add_eos=True)]
        results = translator.translate_batch(pieces, beam_size=beam_size, length_penalty=alpha,
                                             max_decoding_length=max_length,
                                             min_decoding_length=0,  # ours may end at once
                                             max_batch_size=batch_size)
        return [vocab.decode(vocab.piece_ids(r.hypotheses[0])) for r in results]
      return timed(translate_batch, sentences)
    return run

  return config, dict(zip(ENGINES, (ours, hf, ct2('float32'), ct2('int8'))))


def main(argv):
  del argv
  from benchmarks.measure import add_row, commit, machine, machine_name  # pylint: disable=import-outside-toplevel
  from transformer import bleu, data  # pylint: disable=import-outside-toplevel

  with tempfile.TemporaryDirectory() as directory:
    config, translate = engines(_WORKDIR.value, directory, _BEAM_SIZE.value, _THREADS.value,
                                _BATCH.value)
    sources, references = data.split_texts(config, _SPLIT.value)
    row = {'commit': commit(os.path.dirname(os.path.dirname(__file__))),
           'machine': machine(), 'workdir': _WORKDIR.value, 'split': _SPLIT.value,
           'sentences': len(sources), 'beam_size': _BEAM_SIZE.value, 'alpha': config.alpha,
           'threads': _THREADS.value, 'engines': {}}
    outputs = {}
    for name, run in translate.items():
      outputs[name], seconds = run(sources, config.alpha)
      zero, _ = run(sources, 0.0)
      outputs[f'{name} alpha 0'] = zero
      row['engines'][name] = {
          'sentences_per_sec': len(sources) / seconds,
          'sacrebleu': bleu.sacrebleu_score(outputs[name], references, config.target_lang)[0],
          'identical_to_ours': sum(a == b for a, b in zip(outputs[name], outputs['ours'])),
          'identical_to_ours_alpha_0': sum(a == b for a, b in zip(zero,
                                                                   outputs['ours alpha 0'])),
      }
      print(name, row['engines'][name], flush=True)

  def markdown(rows):
    lines = ['Translating a trained run (`python -m benchmarks.interop_speed`): each engine with '
             'its own length penalty at the run\'s alpha and its own length limit; "identical" '
             'counts translations equal to ours, at that alpha and at alpha 0.', '',
             '| label | commit | split | engine | sentences/s | sacreBLEU | identical | '
             'identical at alpha 0 | beam | alpha | threads | machine |',
             '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
    for label, r in rows.items():
      for name, e in r['engines'].items():
        lines.append(
            f'| {label} | {r["commit"]} | {r["split"]} ({r["sentences"]}) | {name} | '
            f'{e["sentences_per_sec"]:.1f} | {e["sacrebleu"]:.2f} | '
            f'{e["identical_to_ours"]}/{r["sentences"]} | '
            f'{e["identical_to_ours_alpha_0"]}/{r["sentences"]} | {r["beam_size"]} | '
            f'{r["alpha"]} | {r["threads"]} | {machine_name(r["machine"])} |')
    return '\n'.join(lines) + '\n'

  add_row(_OUTPUT.value, 'interop_speed', _LABEL.value, row, markdown)


if __name__ == '__main__':
  app.run(main)
