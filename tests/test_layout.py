"""The codebase's shape, which a reader relies on: the model calls each faster implementation at
one site, and no hardware timing sits in the library or the configs, where it would go stale."""

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent


def test_the_model_calls_each_faster_implementation_at_one_site():
  source = (ROOT / 'transformer' / 'model.py').read_text(encoding='utf-8')
  calls = collections.Counter(re.findall(r'\bkernels\.(\w+)\(', source))
  assert {'attention', 'dropout', 'relu', 'low_precision_logits'} <= set(calls)
  assert all(count == 1 for count in calls.values()), calls


def test_no_hardware_timing_in_the_library_or_the_configs():
  timing = re.compile(r'[0-9] ?(ms|us|TFLOP/s)\b|\b(H100|H200|A100)\b')
  found = [f'{path.relative_to(ROOT)}:{number}: {line.strip()}'
           for folder in ('transformer', 'configs') for path in (ROOT / folder).rglob('*.*')
           if path.suffix in ('.py', '.md')
           for number, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1)
           if timing.search(line)]
  assert not found, 'timings belong in docs/ or benchmarks/results/:\n' + '\n'.join(found)
