r"""Each way translate.py decodes (beam search, its n-best list, top-k and nucleus sampling, greedy
search, an ensemble of two runs), timed side by side on one trained run's sentences.

  python -m benchmarks.decoding_speed --workdir=runs/multi30k [--split=test] [--sentences=N]
      [--beam_size=4] [--repeats=3] [--label=NAME]

Each way is compared with beam search of --beam_size (n-best lists and sampling's draws hold as
many hypotheses; the ensemble is the run twice), in sentences per second in its fastest of
--repeats rounds, each translating the sentences once with every way, the order rotated (other
work only ever slows a round). Adds a row under --label to docs/decoding_speed.{json,md}.
"""

import os

from absl import app, flags

from benchmarks import measure
from transformer import commands, data, translate
from transformer import stored_config

# What `decoding_speed` promises each way, as the share of beam search's sentences per second
# (the ensemble: at most ~2.2x its time).
GOALS = {'nbest': 0.9, 'sampling top-k': 0.9, 'sampling top-p': 0.9, 'ensemble of 2': 1 / 2.2}


def ways(beam_size: int) -> dict[str, dict]:
  """{name: `translate.load`'s arguments} of each way measured."""
  draws = lambda **settings: translate.Sampling(num_samples=beam_size, seed=0, **settings)
  return {'beam search': {},
          'nbest': {'nbest': beam_size},
          'sampling top-k': {'sampling': draws(top_k=10)},
          'sampling top-p': {'sampling': draws(top_p=0.9)},
          'greedy': {'sampling': translate.Sampling(temperature=0.0)},
          'ensemble of 2': {'ensemble': True}}


def measure_ways(workdir: str, sentences: list[str], beam_size: int, repeats: int) -> dict:
  """{way: seconds of each round} of each of `ways`."""
  calls = {}
  for name, way in ways(beam_size).items():
    ensemble = way.pop('ensemble', False)
    translator, params, _, _ = translate.load([workdir] * 2 if ensemble else workdir,
                                              beam_size=beam_size, **way)
    translator.hypotheses(params, sentences)  # compiled
    calls[name] = lambda translator=translator, params=params: translator.hypotheses(params,
                                                                                    sentences)
  return measure.round_robin(calls, repeats)


def markdown(rows: dict) -> str:
  lines = ['# Decoding speed: every way translate.py decodes, against beam search of its width',
           '', 'Written by `python -m benchmarks.decoding_speed`; sentences per second in the '
           'fastest of the rounds, and the ratio to beam search measured in the same process '
           '(goal: the least ratio promised).', '',
           '| label | machine | run, sentences, width | way | sentences/s | vs beam search '
           '(goal) |', '|---|---|---|---|---|---|']
  for label, row in rows.items():
    for way, rate in row['sentences_per_sec'].items():
      goal = f' ({GOALS[way]:.2f})' if way in GOALS else ''
      lines.append(f'| {label} | {measure.machine_name(row["machine"])} | {row["workdir"]}, '
                   f'{row["sentences"]}, {row["beam_size"]} | {way} | {rate:.1f} | '
                   f'{rate / row["sentences_per_sec"]["beam search"]:.2f}{goal} |')
  return '\n'.join(lines) + '\n'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  config = stored_config.load_workdir_config(FLAGS.workdir)
  commands.set_up_jax(config, FLAGS.workdir)
  sentences = data.split_texts(config, FLAGS.split)[0][:FLAGS.sentences]
  seconds = measure_ways(FLAGS.workdir, sentences, FLAGS.beam_size, FLAGS.repeats)
  row = {'machine': measure.machine(), 'commit': measure.commit(os.path.dirname(__file__)),
         'workdir': FLAGS.workdir, 'split': FLAGS.split, 'sentences': len(sentences),
         'beam_size': FLAGS.beam_size, 'round_secs': seconds,
         'sentences_per_sec': {way: len(sentences) / min(rounds)
                               for way, rounds in seconds.items()}}
  measure.add_row(FLAGS.output, 'decoding_speed', FLAGS.label, row, markdown)


if __name__ == '__main__':  # flags here: the tests import the module beside other benchmarks
  flags.DEFINE_string('workdir', None, 'A trained train.py workdir.')
  flags.DEFINE_string('split', 'test', "The run dataset's split to translate.")
  flags.DEFINE_integer('sentences', 1000, 'Its first N sentences.', lower_bound=1)
  flags.DEFINE_integer('beam_size', 4, 'Beam size, n-best size and draws per sentence.',
                       lower_bound=1)
  flags.DEFINE_integer('repeats', 3, 'Rounds of every way.', lower_bound=1)
  flags.DEFINE_string('label', 'current', 'Name of this measurement in the results.')
  flags.DEFINE_string('output', os.path.join(os.path.dirname(__file__), '..', 'docs'),
                      'Where decoding_speed.json and decoding_speed.md go.')
  flags.mark_flag_as_required('workdir')
  FLAGS = flags.FLAGS
  app.run(main)
