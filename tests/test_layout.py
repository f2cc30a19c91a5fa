"""The codebase's shape, which a reader relies on: the model calls each faster implementation at
one site, no hardware timing sits in the library or the configs, where it would go stale, and the
README's troubleshooting table quotes the messages the code gives."""

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent


def test_the_model_calls_each_faster_implementation_at_one_site():
  source = (ROOT / 'transformer' / 'model.py').read_text(encoding='utf-8')
  calls = collections.Counter(re.findall(r'\bkernels\.(\w+)\(', source))
  assert {'fused_attention', 'dropout', 'relu', 'low_precision_logits'} <= set(calls)
  assert all(count == 1 for count in calls.values()), calls


def test_no_hardware_timing_in_the_library_or_the_configs():
  timing = re.compile(r'[0-9] ?(ms|us|TFLOP/s)\b|\b(H100|H200|A100)\b')
  found = [f'{path.relative_to(ROOT)}:{number}: {line.strip()}'
           for folder in ('transformer', 'configs') for path in (ROOT / folder).rglob('*.*')
           if path.suffix in ('.py', '.md')
           for number, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1)
           if timing.search(line)]
  assert not found, 'timings belong in docs/ or benchmarks/results/:\n' + '\n'.join(found)


def test_the_readmes_troubleshooting_lines_are_the_codes_messages():
  readme = (ROOT / 'README.md').read_text(encoding='utf-8')
  table = readme.split('## When something goes wrong')[1].split('\n## ')[0]
  quoted = [quote for row in table.splitlines() if row.startswith('| `')
            for quote in re.findall(r'`([^`]+)`', row.split(' | ')[0])]
  code = '\n'.join(path.read_text(encoding='utf-8')
                   for path in [*ROOT.glob('*.py'), *(ROOT / 'transformer').rglob('*.py')])
  # The runs of words between placeholders (DIR, N, ...), elisions and punctuation, as the code
  # writes them; the operating system's reasons are its own.
  pieces = [piece.strip() for quote in quoted
            for piece in re.split(r'\b[A-Z]{1,3}\b|\.\.\.|[(),;:"]', quote)
            if len(piece.split()) >= 2 and piece.strip() not in OS_REASONS]
  assert len(quoted) >= 6 and len(pieces) >= 10
  assert [piece for piece in pieces if piece not in code] == []


OS_REASONS = ('No space left on device', 'Permission denied')
