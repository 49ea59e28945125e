"""`fedgpu ui`: which URL it prints and when it opens a browser."""

from __future__ import annotations

import pytest

from fedgpu.cli.ui import dashboard_url, has_display


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "http://127.0.0.1:8080/"),
    ("0.0.0.0", "http://127.0.0.1:8080/"),  # listening everywhere: reach it on loopback
    ("::", "http://127.0.0.1:8080/"),
    ("::1", "http://[::1]:8080/"),
    ("agg.example.org", "http://agg.example.org:8080/"),
])
def test_dashboard_url(host: str, url: str) -> None:
    assert dashboard_url(host, 8080) == url


def test_a_browser_only_with_a_display(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.platform", "linux")
    for name in ("DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    assert not has_display()  # e.g. over plain SSH
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    assert has_display()
    monkeypatch.delenv("WAYLAND_DISPLAY")
    monkeypatch.setenv("DISPLAY", ":0")
    assert has_display()
