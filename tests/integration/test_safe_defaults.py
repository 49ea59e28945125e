"""Safe defaults of `fedgpu server start`: loopback unless --host says otherwise, a warning for
plaintext on any other address, metrics on loopback unless --metrics-host says otherwise, and a
port in use is an error at start that names it (gRPC's SO_REUSEPORT would let a second
aggregator share the port, answering half the calls with the wrong token).

Threat model: an aggregator started by hand on a host with a public interface, without TLS or
with an unauthenticated metrics port; these defaults keep both off the network until the
operator says otherwise, by name."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from tests.fixtures.federation import Federation, cli, free_port


def _v4(word: str) -> str:
    return ".".join(str(int(word[i:i + 2], 16)) for i in (6, 4, 2, 0))


def _listeners(port: int) -> set[str]:
    """The local addresses listening on TCP `port` ("any" for every interface), from
    /proc/net/tcp and tcp6 (gRPC binds IPv4 as ::ffff:a.b.c.d)."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            addr, p = fields[1].split(":")
            if int(p, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            if len(addr) == 8:
                found.add(_v4(addr))
            elif addr[:24] == "0000000000000000FFFF0000":
                found.add(_v4(addr[24:]))
            else:
                found.add("::" if set(addr) == {"0"} else addr)
    return {"any" if a in ("0.0.0.0", "::") else a for a in found}


def _wait_for(proc, text: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in proc.text():
            return
        assert proc.popen.poll() is None, proc.text()[-2000:]
        time.sleep(0.2)
    raise AssertionError(f"never logged {text!r}: {proc.text()[-2000:]}")


def test_loopback_by_default_and_metrics_too(federation: Federation) -> None:
    port, metrics = free_port(), free_port()
    proc = federation.spawn("aggregator", ["server", "start", "--port", str(port),
                                           "--metrics-port", str(metrics)])
    _wait_for(proc, f"listening on 127.0.0.1:{port}")
    assert _listeners(port) == {"127.0.0.1"}
    assert _listeners(port + 1) == {"127.0.0.1"}  # the bulk port, on the same --host
    assert _listeners(metrics) == {"127.0.0.1"}
    # Plaintext on loopback crosses no network: nothing to warn about.
    assert "plaintext" not in proc.text().split("listening on")[0]


def test_plaintext_on_every_interface_is_warned_about(federation: Federation) -> None:
    port, metrics = free_port(), free_port()
    proc = federation.spawn("aggregator", ["server", "start", "--host", "0.0.0.0", "--port",
                                           str(port), "--metrics-port", str(metrics)])
    _wait_for(proc, f"listening on 0.0.0.0:{port}")
    assert "serving plaintext on 0.0.0.0 (not loopback)" in proc.text()
    assert _listeners(port) == {"any"}
    assert _listeners(metrics) == {"127.0.0.1"}  # metrics stay on loopback unless asked
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=30) == 0


def test_a_second_aggregator_on_a_port_in_use_fails_naming_it(federation: Federation) -> None:
    federation.start_server(None)
    port = federation.address.rsplit(":", 1)[1]
    r = cli("server", "start", "--host", "127.0.0.1", "--port", port, "--bulk-port", "0",
            timeout=60)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # The first one still answers alone.
    assert federation.query("GetStatus")["state"] in ("idle", "waiting")


@pytest.mark.parametrize(("flag", "says"), [
    ("--bulk-port", "cannot listen on the bulk port 127.0.0.1:{port}"),
    ("--ui-port", "cannot serve the dashboard on 127.0.0.1:{port}"),
    ("--metrics-port", "cannot serve metrics on 127.0.0.1:{port}"),
])
def test_every_port_in_use_fails_at_start_naming_it(flag: str, says: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = cli("server", "start", "--port", str(free_port()), flag, str(port), timeout=60)
    assert r.returncode == 1, r.stderr[-2000:]
    assert says.format(port=port) in r.stderr and "Traceback" not in r.stderr, r.stderr
