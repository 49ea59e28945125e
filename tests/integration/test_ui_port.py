"""`fedgpu ui` asks the aggregator where its dashboard is (GetStatus's "dashboard"), instead of
assuming port 8080."""

from __future__ import annotations

import json

from tests.fixtures.federation import Federation, cli, free_port


def test_ui_finds_the_dashboard_port_the_aggregator_reports(federation: Federation) -> None:
    ui = free_port()
    federation.start_server(None, "--ui-port", str(ui))
    status = json.loads(cli("status", "--json", "--address", federation.address).stdout)
    assert status["dashboard"] == {"host": "127.0.0.1", "port": ui}
    r = cli("ui", "--address", federation.address, "--no-open")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"http://127.0.0.1:{ui}/"


def test_ui_says_when_the_aggregator_serves_no_dashboard(federation: Federation) -> None:
    federation.start_server(None)
    assert json.loads(cli("status", "--json", "--address",
                          federation.address).stdout)["dashboard"] is None
    r = cli("ui", "--address", federation.address, "--no-open")
    assert r.returncode == 1
    assert "serves no dashboard: start it with --ui-port PORT" in r.stderr, r.stderr
    assert r.stdout == ""  # no URL that leads nowhere
