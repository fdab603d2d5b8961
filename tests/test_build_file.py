"""The Bazel BUILD file names every module and every test file, and nothing that does not exist.

BUILD is generated: when a test here fails, run  python scripts/gen_build.py  and commit the new BUILD.
BUILD is Starlark; with native rules and literal lists only, it is also valid Python, so it is read with ``ast``.
"""
from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIX = "BUILD is out of date: run  python scripts/gen_build.py  (then commit BUILD)"


def _gen_build():
  spec = importlib.util.spec_from_file_location("gen_build", ROOT / "scripts" / "gen_build.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


gen_build = _gen_build()


def _literal(node):
  return ast.literal_eval(node)


@pytest.fixture(scope="module")
def rules():
  """BUILD's rules as a list of (kind, {attribute: value})."""
  path = ROOT / "BUILD"
  assert path.exists(), f"BUILD is missing. {FIX}"
  tree = ast.parse(path.read_text(), filename="BUILD")
  out = []
  for stmt in tree.body:
    assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call), (
        f"BUILD line {stmt.lineno}: only rule calls are expected. {FIX}")
    call = stmt.value
    kind = call.func.id
    assert kind in ("py_library", "py_test"), (
        f"BUILD line {stmt.lineno}: {kind}() (no load(), glob() or other rules: native py rules only)")
    assert not call.args, f"BUILD line {stmt.lineno}: positional arguments"
    out.append((kind, {kw.arg: _literal(kw.value) for kw in call.keywords}))
  return out


def _named(rules, kind):
  return {attrs["name"]: attrs for k, attrs in rules if k == kind}


def test_library_names_every_module(rules):
  libs = _named(rules, "py_library")
  assert "mla_pallas" in libs, f"BUILD has no py_library 'mla_pallas'. {FIX}"
  listed = set(libs["mla_pallas"]["srcs"])
  on_disk = set(gen_build.library_srcs())
  assert not on_disk - listed, f"modules missing from BUILD: {sorted(on_disk - listed)}. {FIX}"
  assert not listed - on_disk, f"BUILD names modules that do not exist: {sorted(listed - on_disk)}. {FIX}"


def test_one_py_test_per_test_file(rules):
  tests = _named(rules, "py_test")
  by_main = {attrs["main"]: attrs for attrs in tests.values()}
  on_disk = set(gen_build.test_files())
  assert not on_disk - set(by_main), f"test files missing from BUILD: {sorted(on_disk - set(by_main))}. {FIX}"
  assert not set(by_main) - on_disk, (
      f"BUILD names test files that do not exist: {sorted(set(by_main) - on_disk)}. {FIX}")
  for main, attrs in by_main.items():
    assert attrs["srcs"][0] == main and "tests/conftest.py" in attrs["srcs"], (main, attrs["srcs"], FIX)
    assert attrs["deps"] == [":mla_pallas"], (main, attrs["deps"], FIX)
    tags = attrs.get("tags", [])
    if main.endswith("_gpu.py"):
      assert {"gpu", "requires-gpu-nvidia"} <= set(tags), (main, tags, FIX)
    else:
      assert "gpu" not in tags, (main, tags, FIX)


def test_every_named_file_exists(rules):
  missing = sorted({src for _, attrs in rules for src in attrs.get("srcs", []) + [attrs.get("main")]
                    if src and not (ROOT / src).is_file()})
  assert not missing, f"BUILD names files that do not exist: {missing}. {FIX}"


def test_names_are_unique(rules):
  names = [attrs["name"] for _, attrs in rules]
  assert len(names) == len(set(names)), f"duplicate target names in BUILD. {FIX}"


def test_build_matches_generator():
  # Strictest check last: BUILD is exactly what the generator writes (it is never edited by hand).
  assert (ROOT / "BUILD").read_text() == gen_build.render(), FIX


def test_workspace_exists():
  assert (ROOT / "WORKSPACE").is_file(), "WORKSPACE (empty) marks the Bazel workspace root"
