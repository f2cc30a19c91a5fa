"""The three BLEUs on fixed text against values computed here independently."""

import collections
import math

import pytest
import sacrebleu

from conftest import run_script
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
  assert bleu.paper_tokenize(['Ein Boston-Terrier, saftig-grünes Gras - gut.'], 'de', True) == [
      'Ein Boston ##AT##-##AT## Terrier , saftig ##AT##-##AT## grünes Gras - gut .']
  # perl's non-overlapping s///g leaves the second hyphen of 'a-b-c' alone.
  assert bleu.paper_tokenize(['a-b-c'], 'en', True) == ['a ##AT##-##AT## b-c']
  # Without it (French by default) compounds stay whole.
  assert bleu.paper_tokenize(['Un porte-monnaie rouge-vif.'], 'fr', False) == [
      'Un porte-monnaie rouge-vif .']


@pytest.mark.parametrize('compound_split', [True, False])
def test_paper_bleu_is_multi_bleu_on_the_paper_tokenization(compound_split):
  expected = multi_bleu(bleu.paper_tokenize(HYPOTHESES, 'de', compound_split),
                        bleu.paper_tokenize(REFERENCES, 'de', compound_split))
  assert 20 < expected < 80
  got = bleu.paper_bleu(HYPOTHESES, REFERENCES, 'de', compound_split)
  assert got == pytest.approx(expected, abs=1e-9)
  assert bleu.paper_bleu(REFERENCES, REFERENCES, 'de', compound_split) == pytest.approx(100.0)


def test_sacrebleu_matches_sacrebleu_and_reports_its_signature():
  score, signature = bleu.sacrebleu_score(HYPOTHESES, REFERENCES, 'de')
  assert score == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score, abs=1e-9)
  assert signature.startswith('nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:')
  assert score != pytest.approx(bleu.paper_bleu(HYPOTHESES, REFERENCES, 'de', True))


def test_chrf_on_fixed_text_worked_by_hand():
  # Characters, spaces removed; n-gram statistics summed over both lines, then each order's
  # F-score (beta 2) averaged over the orders that occur. 'ab cd' against 'abce' and 'xy' against
  # itself: 1-grams a b c d x y / a b c e x y, 5 of 6 both ways; 2-grams ab bc cd xy / ab bc ce
  # xy, 3 of 4; 3-grams abc bcd / abc bce, 1 of 2; 4-grams abcd / abce, 0 of 1. Precision and
  # recall are equal at each order, so each F is that share.
  by_hand = 100 * (5 / 6 + 3 / 4 + 1 / 2 + 0) / 4
  score, signature = bleu.chrf_score(['ab cd', 'xy'], ['abce', 'xy'])
  assert score == pytest.approx(by_hand, abs=1e-9) and by_hand == pytest.approx(52.08, abs=0.01)
  assert signature.startswith('nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:')
  assert bleu.chrf_score(REFERENCES, REFERENCES)[0] == pytest.approx(100.0)


def test_paper_pipeline_normalises_quotes_and_punctuation_on_both_sides():
  lines = ['Ein Mann sagt: “Hallo!”', 'Zwei Hunde spielen im Schnee…',
           'Ein Kind trägt ein rot-weißes T-Shirt – es ist’s',
           '„Sieh mal“, ruft sie（lacht）３０％ «oui» ‟so〞']
  # Worked by hand: every double quotation mark made '"', replace-unicode-punctuation.perl
  # (… -> ..., ’ -> ', full-width brackets, digits and % -> ASCII; – is not in its table),
  # tokenizer.perl -l de (which escapes " and '), then the compound split.
  assert bleu.paper_tokenize(bleu.paper_normalize(lines), 'de', True) == [
      'Ein Mann sagt : &quot; Hallo ! &quot;',
      'Zwei Hunde spielen im Schnee ...',
      'Ein Kind trägt ein rot ##AT##-##AT## weißes T ##AT##-##AT## Shirt – es ist &apos; s',
      '&quot; Sieh mal &quot; , ruft sie ( lacht ) 30 % &quot; oui &quot; &quot; so &quot;']
  # A hypothesis equal to its reference scores 100 whatever its quotes: both sides are
  # normalised (get_ende_bleu.sh normalised the hypotheses only, so „ “ in both scored less).
  german = ['„Sieh mal“, ruft sie, „da drüben!“']
  assert bleu.paper_bleu(german, german, 'de', True) == pytest.approx(100.0)
  curly, straight = ['Er sagt: „Ja“, sie sagt nein.'], ['Er sagt: "Ja", sie sagt nein.']
  assert bleu.paper_bleu(curly, straight, 'de', True) == pytest.approx(100.0)
  assert bleu.paper_bleu(straight, curly, 'de', True) == pytest.approx(100.0)


def test_paper_variant_names_what_was_done():
  assert bleu.paper_variant(True) == (
      'double quotes made ", replace-unicode-punctuation.perl, tokenizer.perl, ##AT## compound '
      'split (hypotheses and references), multi-bleu.perl')
  assert '##AT##' not in bleu.paper_variant(False)


def test_lowercase_pipeline_makes_multi30ks_tokenized_files():
  # Worked by hand: lowercase.perl, normalize-punctuation.perl -l LANG (curly and angle quotes,
  # ’ and … made ASCII; in English a comma after a closing quote moves inside it), then
  # tokenizer.perl -l LANG (which escapes " and ', and splits French elisions after the ').
  assert bleu.lowercase_tokenize(['Ein Schild sagt „Stopp“.', 'Ein Hund rennt…'], 'de') == [
      'ein schild sagt &quot; stopp &quot; .', 'ein hund rennt ...']
  assert bleu.lowercase_tokenize(["L'Homme porte un T-shirt « rouge » dans l’herbe."], 'fr') == [
      'l&apos; homme porte un t-shirt &quot; rouge &quot; dans l&apos; herbe .']
  assert bleu.lowercase_tokenize(['A man said "Hello", then left.'], 'en') == [
      'a man said &quot; hello , &quot; then left .']


def test_lowercase_bleu_on_fixed_text_worked_by_hand():
  hypotheses = ['Zwei Hunde spielen im Schnee.', 'Ein Schild sagt „Stopp“.']
  references = ['zwei Hunde spielen im tiefen Schnee.', 'Ein Schild sagt "Stopp".']
  # Tokens: 'zwei hunde spielen im schnee .' (6) against 'zwei hunde spielen im tiefen schnee .'
  # (7): 1-grams 6/6, 2-grams 4/5, 3-grams 2/4, 4-grams 1/3; 'ein schild sagt &quot; stopp
  # &quot; .' (7) on both sides: 7/7, 6/6, 5/5, 4/4. Corpus: 13/13, 10/11, 7/9, 5/7; 13
  # hypothesis tokens against 14.
  by_hand = 100 * math.exp(1 - 14 / 13) * (13 / 13 * 10 / 11 * 7 / 9 * 5 / 7) ** (1 / 4)
  assert by_hand == pytest.approx(78.06, abs=0.01)
  assert bleu.lowercase_bleu(hypotheses, references, 'de') == pytest.approx(by_hand, abs=1e-9)
  # Case and quotes count in the other two: 'Zwei' is not 'zwei', nor „ a '"' to sacreBLEU.
  assert bleu.sacrebleu_score(hypotheses, references, 'de')[0] < by_hand - 10
  assert bleu.lowercase_variant('de') == (
      'lowercase.perl, normalize-punctuation.perl -l de, tokenizer.perl -l de (hypotheses and '
      "references, as Multi30k's task1-tokenize.sh), multi-bleu.perl")


@pytest.mark.slow
def test_train_py_starts_without_importing_sacremoses():
  """sacremoses compiles its regular expressions on import (0.2 s): train.py's start leaves it to
  the first paper BLEU."""
  result = run_script('-c', 'import sys, train; print(sorted(m for m in sys.modules '
                            'if m.split(".")[0] in ("sacremoses", "transformer")))')
  assert result.returncode == 0, result.stderr
  loaded = result.stdout.split('\n')[-2]
  assert 'transformer.bleu' in loaded and 'sacremoses' not in loaded, loaded
