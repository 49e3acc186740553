"""A parent process for cluster_test.py, to be interrupted: it builds a 2-host cluster, starts a
process on each host that only waits, prints `READY <run id> <pid> <pid>` and waits for a
signal (SIGTERM, SIGINT) or SIGKILL.

    python tests/_cluster_parent.py
"""

from __future__ import annotations

import signal
import subprocess
import sys

from equarx_serve.distributed.cluster import Cluster, Link

WAITER = "import os, time; print(os.getpid(), flush=True); time.sleep(3600)"


def main() -> None:
    # Ctrl-C as a terminal delivers it: a background job of a shell (a CI script's `cmd &`)
    # starts with SIGINT ignored, and this process would inherit that.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with Cluster(2, Link.parse("100mbit")) as cluster:
        waiters = [
            subprocess.Popen(
                cluster.command(host, [sys.executable, "-c", WAITER]),
                stdout=subprocess.PIPE,
                text=True,
            )
            for host in range(2)
        ]
        pids = [waiter.stdout.readline().strip() for waiter in waiters]
        print("READY", cluster.run, *pids, flush=True)
        signal.pause()


if __name__ == "__main__":
    main()
