"""The benchmarks' emulated links: `--link RATE [--link-delay D]` for `--processes N`.

With `--link`, the N processes of a multi-process mesh run on N emulated hosts joined by links
shaped to RATE each way (`distributed/cluster.py`: network namespaces, a bridge, tc; needs root),
gloo carrying the collectives over real TCP on those links. Before the first measurement on a
mesh, the TCP goodput between two hosts is measured and printed (`Cluster.measure_link`); the
efficiencies use that MEASURED rate, not the configured one:

  link-limited ms   the time the bytes a device sends need at the measured rate
  vs link           link-limited ms / the measured time (1.0: the method runs at the speed of
                    the link; every method's bytes are counted from its compiled HLO)
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from equarx_serve.distributed.cluster import Cluster, ClusterError, Link, check_privileges

if TYPE_CHECKING:
    from equarx_serve.distributed.multiprocess import Hosts


def add_arguments(parser: argparse.ArgumentParser, argument_type: Callable) -> None:
    """--link and --link-delay; `argument_type` turns a parser's ValueError into a usage error."""
    parser.add_argument(
        "--link",
        type=argument_type(lambda text: Link.parse(text).rate_bits_per_s),
        metavar="RATE",
        help="run the --processes on emulated hosts joined by links of RATE each way, in tc "
        "syntax (1gbit, 500mbit, 10gbit): network namespaces, gloo over real TCP; needs root",
    )
    parser.add_argument(
        "--link-delay",
        type=argument_type(lambda text: Link.parse("1gbit", text).delay_us),
        metavar="DELAY",
        help="with --link: one-way delay between two hosts, e.g. 0.2ms (default: none)",
    )


def link_from_args(args: argparse.Namespace, *, processes: bool) -> Link | None:
    """The Link the flags ask for (None without --link). ValueError when --link cannot be used:
    no multi-process mesh to put on it, or no root (it fails here, before anything runs)."""
    if args.link is None:
        if args.link_delay is not None:
            raise ValueError("--link-delay needs --link")
        return None
    if not processes:
        raise ValueError("--link emulates hosts for the processes of --processes N: add it")
    try:
        check_privileges()
    except ClusterError as e:
        raise ValueError(str(e)) from None
    return Link(args.link, args.link_delay or 0)


@contextlib.contextmanager
def hosts_for(num_processes: int, link: Link | None) -> Iterator[tuple[Hosts | None, dict | None]]:
    """(hosts for `multiprocess.run_local_processes`, the link measurement as a dict): N emulated
    hosts on `link` with the link measured and printed, torn down on leaving; (None, None)
    without a link (loopback)."""
    if link is None:
        yield None, None
        return
    with Cluster(num_processes, link) as cluster:
        measurement = cluster.measure_link()
        print(measurement.summary(), flush=True)
        yield cluster, measurement.as_dict()


def link_time_ms(wire_bytes: int, link: dict | None) -> float | None:
    """The time `wire_bytes` need at the measured rate of `link` (a measurement from
    `hosts_for`); None without a link."""
    if link is None:
        return None
    return 8 * wire_bytes / link["measured_bits_per_s"] * 1e3
