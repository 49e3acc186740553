"""What the tests of emulated hosts share: the marker for tests that need root."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from equarx_serve.distributed import cluster


def missing_privileges() -> str | None:
    """Why this process cannot build an emulated cluster; None when it can."""
    try:
        cluster.check_privileges()
    except cluster.ClusterError as e:
        return str(e)
    return None


_skip_without_root = pytest.mark.skipif(
    missing_privileges() is not None, reason=f"needs root: {missing_privileges()}"
)
# conftest.py's fixture: one test of emulated hosts at a time on this machine.
_alone = pytest.mark.usefixtures("emulated_hosts_alone")


def needs_root(test: Callable) -> Callable:
    """Marks a test of emulated hosts: skipped without root, never beside another such test
    (they check that nothing of theirs is left in the machine-wide namespaces)."""
    return _alone(_skip_without_root(test))
