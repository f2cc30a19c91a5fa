"""The language pairs a run translates: config.pairs (a multilingual model, each source starting
with the tag of its target language) or config.source_lang-target_lang."""

import re

MULTI30K = ('en', 'de', 'fr')  # Multi30k's languages


def pairs(config) -> list[tuple[str, str]]:
  """(source, target) of each language pair the model translates: config.pairs's, or else the
  one of config.source_lang and target_lang."""
  if config.get('pairs'):
    return [tuple(pair.split('-')) for pair in config.pairs.split(',')]
  return [(config.source_lang, config.target_lang)]


def tag(lang: str) -> str:
  """The piece that starts each source of a multilingual model (config.pairs) to ask for `lang`."""
  return f'<2{lang}>'


def problem(config) -> tuple[str, str, str] | None:
  """(key, value, what is wrong) where config.pairs and config.source_tags cannot go together
  with the rest of the config, else None."""
  tags, given = config.source_tags, config.pairs
  if tags and config.init_from:
    return ('source_tags', tags, "a Marian model's vocabulary (config.init_from) takes no new "
            'pieces: leave it empty')
  if not given:
    return None
  example = "comma-separated pairs of two language codes, e.g. 'en-de,en-fr'"
  for pair in given.split(','):
    languages = pair.split('-')
    if len(languages) != 2 or not all(re.fullmatch(r'[A-Za-z_]+', lang) for lang in languages):
      return 'pairs', given, f'{pair!r} is not a language pair; give {example}'
    if languages[0] == languages[1]:
      return 'pairs', given, f'{pair!r} translates a language into itself; give {example}'
    if config.dataset == 'multi30k' and not set(languages) <= set(MULTI30K):
      return 'pairs', given, f'{pair!r}: Multi30k has {", ".join(MULTI30K)} only'
  if len(set(given.split(','))) != len(given.split(',')) or len(given.split(',')) < 2:
    return ('pairs', given, 'a multilingual model needs two or more different pairs; give '
            f'{example}, or leave it empty for config.source_lang-config.target_lang')
  first = pairs(config)[0]
  if (config.source_lang, config.target_lang) != first:
    return ('pairs', given, f'its first pair is {"-".join(first)} but config.source_lang-'
            f'config.target_lang is {config.source_lang}-{config.target_lang}: set those to the '
            'first pair')
  clash = {tag(target) for _, target in pairs(config)} & set(tags.split(','))
  if clash:
    return ('source_tags', tags, f'{clash.pop()} is the tag of a target language of config.pairs '
            'already')
  if config.init_from:
    return ('pairs', given, 'a Marian model (config.init_from) has no tags of ours for its target '
            'languages: fine-tune it on one pair, with config.pairs empty')
  return None
