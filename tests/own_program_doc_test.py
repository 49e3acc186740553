"""docs/own-program.md's one-process example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).parents[1] / "docs" / "own-program.md"


def test_the_one_process_example_runs():
    one_process = DOC.read_text().split("## Several processes")[0]
    (code,) = re.findall(r"```python\n(.*?)```", one_process, re.DOTALL)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the example sets its own device count
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok (4, 8, 1024) bfloat16")
