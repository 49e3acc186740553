#!/usr/bin/env bash
# The checks that need a GPU or TPU (equarx_serve/bench/device_check.py), as one command of
# under 5 minutes: the Pallas kernel's bits against its reference, its throughput beside the
# device's copy rate, and a TP = 1 Gemma 3 270M prefill with the project's engine. Run it on
# a machine with an accelerator and a JAX for it installed (`PYTHON`, default python3); the
# project is used from this checkout, not installed. Never part of the suite: CI has none.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 300 "${PYTHON:-python3}" -m equarx_serve.bench.device_check "$@"
