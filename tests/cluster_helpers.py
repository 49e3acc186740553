"""What the tests of emulated hosts share: the skip marker for tests that need root."""

from __future__ import annotations

import pytest

from equarx_serve import cluster


def missing_privileges() -> str | None:
    """Why this process cannot build an emulated cluster; None when it can."""
    try:
        cluster.check_privileges()
    except cluster.ClusterError as e:
        return str(e)
    return None


needs_root = pytest.mark.skipif(
    missing_privileges() is not None, reason=f"needs root: {missing_privileges()}"
)
