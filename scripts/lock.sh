#!/usr/bin/env bash
# Re-resolves requirements.lock from pyproject.toml (the dependencies and the dev extra) for
# every platform and Python >= 3.12, with the sha256 of every file. Versions already in the
# lock are kept while they still satisfy pyproject.toml; extra arguments go to
# `uv pip compile`, e.g. `--upgrade` (everything to the newest allowed) or
# `--upgrade-package jax`. Then run `make test` and commit the lock with the change.
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${UV:-.venv/bin/uv}
if [ ! -x "$uv" ]; then
  echo "error: no uv at $uv: run 'make .venv/.installed' first, or set UV=/path/to/uv" >&2
  exit 1
fi
"$uv" pip compile pyproject.toml --extra dev --universal --python-version 3.12 \
  --generate-hashes --quiet --output-file requirements.lock "$@"
