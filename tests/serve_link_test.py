"""`serve --processes N --link RATE`: the processes on emulated hosts, process 0's HTTP port
forwarded from the root namespace into host 0 (`port_forward.py`), everything gone afterwards;
and the flags' checks, which need no root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from _serving import wait_healthy
from cluster_helpers import needs_root

from equarx_serve.arguments import UsageError
from equarx_serve.cli import processes
from equarx_serve.distributed.cluster import Cluster, Link
from equarx_serve.distributed.multiprocess import free_port
from equarx_serve.distributed.port_forward import forward_into

MODEL = "tiny"
SERVE = [sys.executable, "-m", "equarx_serve", "serve", "--model", MODEL, "--tp", "2"]
SERVE += ["--max-length", "256", "--log-level", "warning"]
START_TIMEOUT_S = 240  # the link measured, two processes load and compile on a shared CPU


def _our_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return sorted(line.split()[0] for line in listed.stdout.splitlines() if "equarx-" in line)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--link", "1gbit"], "--link emulates hosts for the processes of --processes N"),
        (["--processes", "2", "--link-delay", "1ms"], "--link-delay needs --link"),
        (["--processes", "2", "--link", "fast"], "--link"),
    ],
)
def test_bad_link_flags_are_usage_errors(flags, message, capsys):
    from equarx_serve import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", MODEL, *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_members_run_the_command_line_without_the_launchers_flags(monkeypatch):
    argv = ["serve", "--processes", "2", "--link=1gbit", "--link-delay", "1ms", "--port", "9"]
    monkeypatch.setattr(sys, "argv", ["equarx-serve", *argv])
    assert processes._member_argv("serve")[3:] == ["serve", "--port", "9"]
    monkeypatch.setattr(sys, "argv", ["equarx-serve", "serve", "--link-del", "1ms"])
    with pytest.raises(UsageError, match="spell --link-delay in full"):
        processes._member_argv("serve")


SERVER_IN_HOST = (
    "import http.server as h; h.test(h.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')"
)


@needs_root
def test_a_port_inside_an_emulated_host_is_reachable_from_the_root_namespace(tmp_path):
    (tmp_path / "hello.txt").write_text("from host 0")
    with Cluster(2, Link.parse("1gbit")) as hosts:
        inside = hosts.next_port()
        server = subprocess.Popen(
            hosts.command(0, [sys.executable, "-c", SERVER_IN_HOST.format(port=inside)]),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            with httpx.Client() as client:
                # Not reachable in the root namespace without the forwarder.
                with pytest.raises(httpx.TransportError):
                    client.get(f"http://127.0.0.1:{inside}/hello.txt", timeout=2)
                with forward_into(hosts.namespace_path(0), inside, ("127.0.0.1", 0)) as address:
                    url = f"http://{address[0]}:{address[1]}"
                    wait_healthy_file(client, f"{url}/hello.txt", server)
                    assert client.get(f"{url}/hello.txt").text == "from host 0"
                with pytest.raises(httpx.TransportError):  # the forwarder is gone
                    client.get(f"{url}/hello.txt", timeout=2)
        finally:
            server.kill()
            server.wait()


def wait_healthy_file(client: httpx.Client, url: str, server: subprocess.Popen) -> None:
    """Until the server in the host answers (the forwarder closes connections it refuses)."""
    for _ in range(600):
        assert server.poll() is None, "the server in host 0 exited"
        try:
            client.get(url, timeout=2)
            return
        except httpx.TransportError:
            continue
    raise AssertionError("the server in host 0 did not answer")


@needs_root
def test_serve_on_two_emulated_hosts_answers_and_leaves_nothing_behind(tmp_path):
    before = _our_namespaces()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    stderr = tmp_path / "stderr.txt"
    command = [*SERVE, "--processes", "2", "--link", "1gbit", "--port", str(port)]
    with stderr.open("w") as err:
        launcher = subprocess.Popen(command, env=env, stderr=err)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [launcher], START_TIMEOUT_S)
        body = {"prompt": "hello the world", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        assert "equarx_processes 2.0" in httpx.get(f"{url}/metrics").text
        assert len(_our_namespaces()) == len(before) + 3  # 2 hosts and the switch
        launcher.send_signal(signal.SIGTERM)  # drains, stops the follower, tears down
        assert launcher.wait(120) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    log = stderr.read_text()
    assert "measured TCP goodput" in log and f"serving on http://127.0.0.1:{port}" in log
    assert _our_namespaces() == before
