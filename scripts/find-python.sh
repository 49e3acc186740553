#!/usr/bin/env bash
# Prints the path of a working Python >= 3.12, or fails with a message saying what was tried.
# Tries $PYTHON, python3.12/python3.13 on the PATH (a pyenv shim that fails is skipped), then
# pyenv's own installs.
set -u
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
candidates+=(python3.12 python3.13 python3)
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root 2>/dev/null)
  for p in "$root"/versions/3.1[2-9]*/bin/python3.1[2-9]; do [ -x "$p" ] && candidates+=("$p"); done
fi
for c in "${candidates[@]}"; do
  if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
    command -v "$c" 2>/dev/null || echo "$c"
    exit 0
  fi
done
echo "error: no Python >= 3.12 found (tried: ${candidates[*]}); install one or set PYTHON=/path/to/python3.12" >&2
exit 1
