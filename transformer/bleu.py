"""BLEU two ways: sacreBLEU on detokenized text, and the paper's tokenized, compound-split BLEU.

The paper's figures come from tensor2tensor's get_ende_bleu.sh: Moses
replace-unicode-punctuation.perl on the hypotheses only (“ ” -> ", ’ -> ', … -> ..., full-width
forms -> ASCII; the script's references were a tokenized file), Moses tokenizer.perl on both,
every '-' between two non-space characters split off as ' ##AT##-##AT## ', then multi-bleu.perl
(corpus BLEU-4, no smoothing, brevity penalty against the reference length).
"""

import re

import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer

_COMPOUND = re.compile(r'(\S)-(\S)')


def paper_tokenize(lines: list[str], lang: str) -> list[str]:
  """Moses tokenization, then compound splitting as in get_ende_bleu.sh."""
  tokenizer = MosesTokenizer(lang=lang)
  out = []
  for line in lines:
    tokens = tokenizer.tokenize(line, return_str=True)
    # One non-overlapping pass, like perl's s{(\S)-(\S)}{...}g: 'a-b-c' keeps 'b-c' whole.
    out.append(_COMPOUND.sub(r'\1 ##AT##-##AT## \2', tokens))
  return out


def sacrebleu_score(hypotheses: list[str], references: list[str], lang: str):
  """(score, signature) of sacreBLEU with its default 13a tokenization."""
  del lang  # 13a is sacreBLEU's default for every target language but zh, ja and ko
  metric = sacrebleu.metrics.BLEU()
  score = metric.corpus_score(hypotheses, [references])
  return score.score, str(metric.get_signature())


def replace_unicode_punctuation(lines: list[str]) -> list[str]:
  """Moses replace-unicode-punctuation.perl (sacremoses' port of its table)."""
  normalizer = MosesPunctNormalizer()
  return [normalizer.replace_unicode_punct(line) for line in lines]


def paper_bleu(hypotheses: list[str], references: list[str], lang: str) -> float:
  """BLEU as get_ende_bleu.sh computes it: multi-bleu.perl on the paper's tokenization."""
  score = sacrebleu.metrics.BLEU(tokenize='none', smooth_method='none', force=True).corpus_score(
      paper_tokenize(replace_unicode_punctuation(hypotheses), lang),
      [paper_tokenize(references, lang)])
  return score.score
