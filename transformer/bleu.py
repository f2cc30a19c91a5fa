"""BLEU three ways: sacreBLEU on detokenized text, the paper's tokenized BLEU, and the
multimodal-translation literature's lowercased BLEU for Multi30k; and sacreBLEU's chrF.

The paper's figures come from tensor2tensor's get_ende_bleu.sh: Moses
replace-unicode-punctuation.perl (“ ” -> ", ’ -> ', … -> ..., full-width forms -> ASCII), Moses
tokenizer.perl, every '-' between two non-space characters split off as ' ##AT##-##AT## ' (for
German), then multi-bleu.perl (corpus BLEU-4, no smoothing, brevity penalty against the reference
length). The script normalised the hypotheses only: its reference was tensor2tensor's tokenized
newstest2014, whose every double quotation mark („ “ ” ...) had been made '"' beforehand
(tensor2tensor issue #317: up to 1.5 BLEU between the variants). Here both sides get both edits,
so that a hypothesis equal to its reference scores 100 whatever quotes they hold.

The multimodal-translation literature's Multi30k figures are a third BLEU: multi-bleu.perl on the
data set's own tokenized files, which Multi30k's scripts/task1-tokenize.sh makes with Moses
lowercase.perl, normalize-punctuation.perl -l LANG and tokenizer.perl -l LANG (`lowercase_bleu`,
on both sides).
"""

import re

import sacrebleu

_COMPOUND = re.compile(r'(\S)-(\S)')
_DOUBLE_QUOTES = re.compile('[„“”‟«»〝〞＂]')


def paper_variant(compound_split: bool) -> str:
  """What `paper_bleu` did, for scores.json."""
  return ('double quotes made ", replace-unicode-punctuation.perl, tokenizer.perl' +
          (', ##AT## compound split' if compound_split else '') +
          ' (hypotheses and references), multi-bleu.perl')


def paper_normalize(lines: list[str]) -> list[str]:
  """Every double quotation mark made '"', then Moses replace-unicode-punctuation.perl
  (sacremoses' port of its table, which leaves „ ‟ « » alone)."""
  # Imported here, not at the top: sacremoses compiles its regular expressions on import, which
  # every train.py start would wait for, for BLEU that comes at the end.
  from sacremoses import MosesPunctNormalizer  # pylint: disable=import-outside-toplevel
  normalizer = MosesPunctNormalizer()
  return [normalizer.replace_unicode_punct(_DOUBLE_QUOTES.sub('"', line)) for line in lines]


def paper_tokenize(lines: list[str], lang: str, compound_split: bool) -> list[str]:
  """Moses tokenization, then (if `compound_split`) compound splitting as in get_ende_bleu.sh."""
  from sacremoses import MosesTokenizer  # pylint: disable=import-outside-toplevel (see above)
  tokenizer = MosesTokenizer(lang=lang)
  out = []
  for line in lines:
    tokens = tokenizer.tokenize(line, return_str=True)
    if compound_split:
      # One non-overlapping pass, like perl's s{(\S)-(\S)}{...}g: 'a-b-c' keeps 'b-c' whole.
      tokens = _COMPOUND.sub(r'\1 ##AT##-##AT## \2', tokens)
    out.append(tokens)
  return out


def paper_bleu(hypotheses: list[str], references: list[str], lang: str,
               compound_split: bool) -> float:
  """BLEU as the paper's figures were computed: multi-bleu.perl on the paper's tokenization of
  both sides (see the module docstring and `paper_variant`)."""
  tokenize = lambda lines: paper_tokenize(paper_normalize(lines), lang, compound_split)
  return _multi_bleu(tokenize(hypotheses), tokenize(references))


def lowercase_variant(lang: str) -> str:
  """What `lowercase_bleu` did, for scores.json."""
  return (f'lowercase.perl, normalize-punctuation.perl -l {lang}, tokenizer.perl -l {lang} '
          "(hypotheses and references, as Multi30k's task1-tokenize.sh), multi-bleu.perl")


def lowercase_tokenize(lines: list[str], lang: str) -> list[str]:
  """`lines` as Multi30k's tok/*.lc.norm.tok.* files hold them: lowercased, Moses-normalized and
  Moses-tokenized (sacremoses' ports of the three scripts)."""
  from sacremoses import (  # pylint: disable=import-outside-toplevel (see paper_normalize)
      MosesPunctNormalizer, MosesTokenizer)
  normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
  return [tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True)
          for line in lines]


def lowercase_bleu(hypotheses: list[str], references: list[str], lang: str) -> float:
  """BLEU as the multimodal-translation literature reports Multi30k: multi-bleu.perl on both
  sides lowercased and tokenized as the data set's scripts do (`lowercase_variant`)."""
  return _multi_bleu(lowercase_tokenize(hypotheses, lang), lowercase_tokenize(references, lang))


def _multi_bleu(hypotheses: list[str], references: list[str]) -> float:
  """multi-bleu.perl on tokenized lines: BLEU-4 on the tokens as they are, no smoothing."""
  return sacrebleu.metrics.BLEU(tokenize='none', smooth_method='none', force=True).corpus_score(
      hypotheses, [references]).score


def chrf_score(hypotheses: list[str], references: list[str]) -> tuple[float, str]:
  """(score, signature) of sacreBLEU's chrF: character 1- to 6-gram F-score with beta 2, spaces
  removed, statistics summed over the corpus (Popovic 2015)."""
  metric = sacrebleu.metrics.CHRF()
  return metric.corpus_score(hypotheses, [references]).score, str(metric.get_signature())


def sacrebleu_score(hypotheses: list[str], references: list[str], lang: str):
  """(score, signature) of sacreBLEU with its default 13a tokenization."""
  del lang  # 13a is sacreBLEU's default for every target language but zh, ja and ko
  metric = sacrebleu.metrics.BLEU()
  score = metric.corpus_score(hypotheses, [references])
  return score.score, str(metric.get_signature())
