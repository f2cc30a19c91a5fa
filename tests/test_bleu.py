"""Both BLEUs on fixed text against values computed here independently."""

import collections
import math

import pytest
import sacrebleu

from transformer import bleu

HYPOTHESES = [
    'Ein Mann mit einem orangefarbenen Hut starrt auf etwas.',
    'Ein Boston-Terrier läuft über das grüne Gras vor einem weißen Zaun.',
    'Ein Mädchen in Karate-Uniform bricht einen Stock mit einem Tritt.',
    'Fünf Leute in Winterjacken und Helmen stehen im Schnee.',
]
REFERENCES = [
    'Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.',
    'Ein Boston Terrier läuft über saftig-grünes Gras vor einem weißen Zaun.',
    'Ein Mädchen in einem Karateanzug bricht einen Stock mit einem Tritt.',
    'Fünf Leute in Winterjacken und mit Helmen stehen im Schnee mit Schneemobilen im Hintergrund.',
]


def multi_bleu(hypotheses: list[str], references: list[str]) -> float:
  """multi-bleu.perl: clipped n-gram precisions 1-4, geometric mean, brevity penalty."""
  matches, totals = [0] * 4, [0] * 4
  hyp_length = ref_length = 0
  for hyp, ref in zip(hypotheses, references):
    h, r = hyp.split(), ref.split()
    hyp_length, ref_length = hyp_length + len(h), ref_length + len(r)
    for n in range(1, 5):
      h_ngrams = collections.Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
      r_ngrams = collections.Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
      matches[n - 1] += sum(min(c, r_ngrams[g]) for g, c in h_ngrams.items())
      totals[n - 1] += max(len(h) - n + 1, 0)
  if min(matches) == 0:
    return 0.0
  log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
  brevity = min(1.0, math.exp(1 - ref_length / hyp_length))
  return 100 * brevity * math.exp(log_precision)


def test_compound_splitting_follows_get_ende_bleu():
  assert bleu.paper_tokenize(['Ein Boston-Terrier, saftig-grünes Gras - gut.'], 'de') == [
      'Ein Boston ##AT##-##AT## Terrier , saftig ##AT##-##AT## grünes Gras - gut .']
  # perl's non-overlapping s///g leaves the second hyphen of 'a-b-c' alone.
  assert bleu.paper_tokenize(['a-b-c'], 'en') == ['a ##AT##-##AT## b-c']


def test_paper_bleu_is_multi_bleu_on_the_paper_tokenization():
  expected = multi_bleu(bleu.paper_tokenize(HYPOTHESES, 'de'),
                        bleu.paper_tokenize(REFERENCES, 'de'))
  assert 20 < expected < 80
  assert bleu.paper_bleu(HYPOTHESES, REFERENCES, 'de') == pytest.approx(expected, abs=1e-9)
  assert bleu.paper_bleu(REFERENCES, REFERENCES, 'de') == pytest.approx(100.0)


def test_sacrebleu_matches_sacrebleu_and_reports_its_signature():
  score, signature = bleu.sacrebleu_score(HYPOTHESES, REFERENCES, 'de')
  assert score == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score, abs=1e-9)
  assert signature.startswith('nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:')
  assert score != pytest.approx(bleu.paper_bleu(HYPOTHESES, REFERENCES, 'de'))


def test_paper_pipeline_normalises_hypothesis_punctuation_as_get_ende_bleu():
  hypotheses = ['Ein Mann sagt: “Hallo!”', 'Zwei Hunde spielen im Schnee…',
                'Ein Kind trägt ein rot-weißes T-Shirt – es ist’s',
                '„Sieh mal“, ruft sie（lacht）３０％']
  # Worked by hand: replace-unicode-punctuation.perl (“ ” -> ", … -> ..., ’ -> ', full-width
  # brackets, digits and % -> ASCII; „ and – are not in its table), tokenizer.perl -l de (which
  # escapes " and '), then the compound split.
  assert bleu.paper_tokenize(bleu.replace_unicode_punctuation(hypotheses), 'de') == [
      'Ein Mann sagt : &quot; Hallo ! &quot;',
      'Zwei Hunde spielen im Schnee ...',
      'Ein Kind trägt ein rot ##AT##-##AT## weißes T ##AT##-##AT## Shirt – es ist &apos; s',
      '„ Sieh mal &quot; , ruft sie ( lacht ) 30 %']
  # The script normalises the hypotheses only, not the references.
  curly, straight = ['Er sagt: “Ja”, sie sagt nein.'], ['Er sagt: "Ja", sie sagt nein.']
  assert bleu.paper_bleu(curly, straight, 'de') == pytest.approx(100.0)
  assert bleu.paper_bleu(straight, curly, 'de') < 60
