"""Execute the notebooks (notebooks/01_quickstart.ipynb, notebooks/02_benchmarks.ipynb) with nbclient.

Every cell runs, as ``jupyter execute`` (``make notebooks``) runs them: a cell that needs a GPU checks for one itself
and prints that it was skipped. The kernel is the Python running the tests: a kernelspec for ``sys.executable`` is
installed into a temporary prefix (``python -m ipykernel install --prefix``) and found through ``JUPYTER_PATH``, so a
user-level ``python3`` kernelspec pointing at another Python cannot be picked up. Notebooks run with the notebooks folder as working directory, as in Jupyter.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "notebooks")
KERNEL = "mla-pallas-test"
HAS_GPU = jax.default_backend() == "gpu"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory, monkeypatch_module):
  prefix = tmp_path_factory.mktemp("jupyter")
  subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", KERNEL,
                  "--display-name", "mla-pallas tests"], check=True, capture_output=True)
  monkeypatch_module.setenv("JUPYTER_PATH", os.path.join(str(prefix), "share", "jupyter"))
  return KERNEL


@pytest.fixture(scope="module")
def monkeypatch_module():
  mp = pytest.MonkeyPatch()
  yield mp
  mp.undo()


def _execute(name, kernel_name):
  nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=300,
                                   resources={"metadata": {"path": NB_DIR}})
  client.execute()
  text = []
  for c in nb.cells:
    for o in c.get("outputs", []):
      if o.get("output_type") == "stream":
        text.append(o.get("text", ""))
      elif o.get("output_type") in ("execute_result", "display_data"):
        text.append(str(o.get("data", {}).get("text/plain", "")))
        if "image/png" in o.get("data", {}):
          text.append("<image/png>")
  return "".join(text)


def test_quickstart_notebook(kernel_name):
  out = _execute("01_quickstart.ipynb", kernel_name)
  assert out.count("[PASS]") == 3, out
  assert "FAIL" not in out
  # the last cell runs the sparse attention kernel (interpret mode without a GPU) and reports it
  assert ("mosaic" if HAS_GPU else "mosaic-interpret") in out, out


def test_benchmarks_notebook(kernel_name):
  out = _execute("02_benchmarks.ipynb", kernel_name)
  assert "<image/png>" in out, out
  assert "PASS" in out, out                        # the small benchmark's check against the reference
  if not HAS_GPU:                                  # the GPU cell ran and skipped itself
    assert "skipped: no GPU here" in out, out
  else:
    assert "mosaic" in out and "skipped" not in out, out
