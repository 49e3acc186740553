"""Where the project keeps what it builds or converts once per machine (converted checkpoints,
compiled kernels): `$EQUARX_SERVE_CACHE`, else `~/.cache/equarx-serve`."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "default_cache_root"]

CACHE_ENV = "EQUARX_SERVE_CACHE"


def default_cache_root() -> Path:
    """`$EQUARX_SERVE_CACHE`, else `~/.cache/equarx-serve`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "equarx-serve"
