#!/usr/bin/env bash
# Creates (or reuses) .venv with a Python >= 3.12 and installs mla-pallas into it, editable, with its test
# extras and the JAX release it is tested against (constraints-test.txt). `make demo` and `make test` run it.
#
# Environment:
#   PYTHON=/path/to/python3.12   interpreter to build .venv with (tried first)
#   MLA_PALLAS_CUDA=13|12|none   JAX CUDA runtime to install. Unset: cuda13 when `nvidia-smi` works, else none.
#                                13 or 12 installs it even where no GPU is visible (e.g. building an image).
#
# Idempotent: when .venv's stamp (.venv/.mla-pallas-stamp) matches the hash of pyproject.toml,
# constraints-test.txt, this script, the CUDA choice and the interpreter, nothing is installed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv
STAMP="$VENV/.mla-pallas-stamp"
JAX_VERSION=0.11.2  # keep in step with constraints-test.txt

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

# True when "$1" runs and is Python >= 3.12. (A pyenv shim for a version that is not selected exits non-zero.)
is_py312() {
  [[ -n "$1" ]] && "$1" -c 'import sys; sys.exit(sys.version_info < (3,12))' >/dev/null 2>&1
}

find_python() {
  local c
  if [[ -n "${PYTHON:-}" ]]; then
    if is_py312 "$PYTHON"; then echo "$PYTHON"; return 0; fi
    echo "setup: warning: PYTHON=$PYTHON is not a working Python >= 3.12; looking for another" >&2
  fi
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && is_py312 "$c"; then command -v "$c"; return 0; fi
  done
  # pyenv: its shims (python3.12, ...) work only for the selected version, so look at its installs directly.
  local root="${PYENV_ROOT:-}"
  if [[ -z "$root" ]] && command -v pyenv >/dev/null 2>&1; then root="$(pyenv root 2>/dev/null || true)"; fi
  [[ -n "$root" ]] || root="${HOME:-}/.pyenv"
  if [[ -d "$root/versions" ]]; then
    # Oldest supported first: 3.12 is what the project's development venv and CI are known to work with.
    while IFS= read -r c; do
      if is_py312 "$c"; then echo "$c"; return 0; fi
    done < <(ls -d "$root"/versions/3.1[2-9]*/bin/python 2>/dev/null | sort -V)
  fi
  return 1
}

# --- the virtual environment -------------------------------------------------------------------------------
if [[ -x "$VENV/bin/python" ]] && is_py312 "$VENV/bin/python"; then
  :  # reuse it
else
  if [[ -e "$VENV" ]]; then
    say "$VENV exists but its python is missing or older than 3.12; recreating it"
    rm -rf "$VENV"
  fi
  if ! PY="$(find_python)"; then
    echo "mla-pallas needs Python >= 3.12; found none. Install one (e.g. pyenv install 3.12) or set" \
         "PYTHON=/path/to/python3.12" >&2
    exit 1
  fi
  say "creating $VENV with $PY ($("$PY" -c 'import platform; print(platform.python_version())'))"
  "$PY" -m venv "$VENV" || die "'$PY -m venv $VENV' failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi

# --- which JAX CUDA runtime ----------------------------------------------------------------------------------
cuda="${MLA_PALLAS_CUDA:-}"
case "$cuda" in
  "" | auto)
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=13; else cuda=none; fi ;;
  13 | cuda13) cuda=13 ;;
  12 | cuda12) cuda=12 ;;
  none | cpu) cuda=none ;;
  *) die "MLA_PALLAS_CUDA must be 13, 12 or none; got '$cuda'" ;;
esac
reqs=(-e ".[test]" "jax==$JAX_VERSION")
if [[ "$cuda" != none ]]; then reqs+=("jax[cuda$cuda]==$JAX_VERSION"); fi

# --- install (skipped when the stamp matches) ----------------------------------------------------------------
pyver="$("$VENV/bin/python" -c 'import sys; print(sys.version)')"
want="$( { cat pyproject.toml constraints-test.txt scripts/setup.sh; echo "cuda=$cuda"; echo "$pyver"; } \
         | sha256sum | cut -d' ' -f1)"
installed() { "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("mla-pallas")' 2>/dev/null; }
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && installed; then
  say "$VENV is up to date (python ${pyver%% *}, cuda: $cuda)"
  exit 0
fi
say "installing mla-pallas[test] and jax==$JAX_VERSION (cuda: $cuda) into $VENV"
rm -f "$STAMP"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints-test.txt "${reqs[@]}" \
  || die "pip install failed (see above)"
echo "$want" > "$STAMP"
say "done: $("$VENV/bin/python" -c 'import jax; print("jax", jax.__version__, "on", jax.default_backend())' \
  2>/dev/null || echo 'installed')"
