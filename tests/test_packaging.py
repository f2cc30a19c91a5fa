"""pyproject.toml: the jax pins admit the releases users run, the accelerator extras resolve
jax's plugins within the same pin, and the README names the Pythons it admits."""

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

import jax
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = pathlib.Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']


def requirement(name: str, lines: list[str]) -> Requirement:
  (found,) = [r for r in map(Requirement, lines) if r.name == name]
  return found


def test_pins_admit_the_installed_jax_and_an_accelerator_image():
  jax_pin = requirement('jax', PROJECT['dependencies']).specifier
  flax_pin = requirement('flax', PROJECT['dependencies']).specifier
  assert jax.__version__ in jax_pin
  # A GPU image's jax 0.11.2 and flax 0.12.10 run this code (benchmarks/results/gpu_speed_h100.md).
  assert '0.11.2' in jax_pin and '0.12.10' in flax_pin


@pytest.mark.parametrize('extra', ['cuda12', 'cuda13', 'tpu'])
def test_accelerator_extras_resolve_jax_within_the_core_pin(extra):
  core = requirement('jax', PROJECT['dependencies']).specifier
  pin = requirement('jax', PROJECT['optional-dependencies'][extra])
  assert pin.extras == {extra}
  upper = lambda specifier: {s.version for s in specifier if s.operator == '<'}
  assert upper(pin.specifier) == upper(core), 'a newer jax than the core pin admits'


def test_buckets_come_with_the_tpu_extra_and_the_tests():
  for extra in ('gcs', 'tpu', 'test'):
    names = {Requirement(line).name for line in PROJECT['optional-dependencies'][extra]}
    assert {'gcsfs', 'google-cloud-storage'} <= names, extra


def test_the_readme_names_the_pythons_the_project_admits():
  first, last = map(int, re.search(r'Python 3\.(\d+)-3\.(\d+)',
                                   (ROOT / 'README.md').read_text()).groups())
  admitted = SpecifierSet(PROJECT['requires-python'])
  assert [minor for minor in range(6, 20) if f'3.{minor}' in admitted] == list(
      range(first, last + 1))


def test_every_package_of_the_library_is_installed():
  """A non-editable install ships only the packages pyproject.toml names."""
  setuptools = tomllib.loads((ROOT / 'pyproject.toml').read_text())['tool']['setuptools']
  named = set(setuptools['packages'])
  found = {'.'.join(path.parent.relative_to(ROOT).parts)
           for path in (ROOT / 'transformer').rglob('__init__.py')}
  assert named == found


def _imported(nodes) -> set[str]:
  names = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      names.update(alias.name.split('.')[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.add(node.module.split('.')[0])
  return names - set(sys.stdlib_module_names) - {'transformer'}


def test_every_package_the_library_imports_is_declared():
  """A package that arrives only through another's dependencies can leave with it. A module's
  own imports are dependencies; imports inside a function (export's) may be an extra's."""
  normal = lambda name: name.lower().replace('_', '-')
  declared = {normal(Requirement(line).name) for line in PROJECT['dependencies']}
  extras = declared | {normal(Requirement(line).name)
                       for lines in PROJECT['optional-dependencies'].values() for line in lines}
  distributions = importlib.metadata.packages_distributions()
  undeclared = {}
  for path in (ROOT / 'transformer').rglob('*.py'):
    tree = ast.parse(path.read_text(encoding='utf-8'))
    functions = [node for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = _imported(n for function in functions for n in ast.walk(function))
    for name in _imported(ast.walk(tree)):
      allowed = extras if name in inside and name not in _imported(tree.body) else declared
      if not {normal(d) for d in distributions.get(name, [])} & allowed:
        undeclared[name] = (str(path.relative_to(ROOT)), distributions.get(name))
  assert not undeclared, f'imported but not in pyproject.toml: {undeclared}'
