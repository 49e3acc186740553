#!/usr/bin/env bash
# Builds (or brings up to date) the virtual environment VENV (default .venv) with exactly the
# versions in requirements.lock, then installs this project into it, editable.
#
#   1. a venv from the Python that scripts/find-python.sh finds, when VENV has none;
#   2. uv, at the version the lock pins, with the venv's pip (only when it is missing);
#   3. `uv pip sync requirements.lock`: every locked package at its locked version and hash,
#      nothing else (packages not in the lock are removed, pip included);
#   4. the project itself, editable, without dependencies of its own (they are all locked);
#   5. `uv pip check`: fails when pyproject.toml needs something the lock lacks (a dependency
#      added without re-locking: run scripts/lock.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
lock=requirements.lock
python=$venv/bin/python
uv=$venv/bin/uv

uv_version=$(sed -n 's/^uv==\([^ ;\\]*\).*/\1/p' "$lock")
if [ -z "$uv_version" ]; then
  echo "error: $lock pins no uv version (uv==...): regenerate it with scripts/lock.sh" >&2
  exit 1
fi
if [ ! -x "$python" ]; then
  "$(scripts/find-python.sh)" -m venv "$venv"
fi
if [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
  "$python" -m pip --version >/dev/null 2>&1 || "$python" -m ensurepip --default-pip >/dev/null
  "$python" -m pip install --quiet --disable-pip-version-check "uv==$uv_version"
fi
"$uv" pip sync --quiet --python "$python" "$lock"
"$uv" pip install --quiet --python "$python" --no-deps -e .
if ! "$uv" pip check --quiet --python "$python"; then
  echo "error: the environment does not satisfy pyproject.toml: was a dependency added" \
    "without re-locking? Run scripts/lock.sh" >&2
  exit 1
fi
