"""The slow-link lines under `fedgpu rounds`' table (issue 37.4): during a round each site's
transfer (bytes, rate, time left); afterwards the last round's rates and the sites it left out
or asked to compress, and why."""

from __future__ import annotations

from typing import Any

from fedgpu.core.link_rates import mbit


def _mbit(bytes_per_s: float | None) -> str:
    return mbit(bytes_per_s) if bytes_per_s else "?"


def lines(doc: dict[str, Any]) -> list[str]:
    out: list[str] = []
    rounds = doc.get("rounds") or []
    link = next((r["link"] for r in reversed(rounds) if r.get("link")), None)
    if link is not None:
        rates = ", ".join(f"{name} down {_mbit(r.get('down_bytes_per_s'))} up "
                          f"{_mbit(r.get('up_bytes_per_s'))}"
                          for name, r in sorted(link.get("rates", {}).items()))
        if rates:
            out.append(f"links: {rates}")
        for s in link.get("skipped", []):
            out.append(f"skipped {s['node']}: {s['reason']}")
        for c in link.get("compressed", []):
            out.append(f"compressed {c['node']}: {c['reason']}")
    progress = doc.get("open")
    if progress is not None:
        out.append(f"round {progress['round']} open, deadline in {progress['deadline_in_s']:g} s")
        for site in progress.get("sites", []):
            out.append(_site_line(site))
    return out


def _site_line(site: dict[str, Any]) -> str:
    """One site of the open round: its phase, and a transfer's direction, bytes done of its
    size, rate and time left, or the rate its last finished transfer moved at."""
    parts = [f"  {site['node']}", site.get("phase") or site["state"]]
    if site.get("direction"):
        parts.append(site["direction"])
    if "bytes" in site:
        parts.append(f"{site['bytes'] / 1e6:.1f}/{site['size'] / 1e6:.1f} MB")
    if site.get("rate_bytes_per_s"):
        parts.append(f"at {_mbit(site['rate_bytes_per_s'])}")
    if site.get("time_left_s") is not None:
        parts.append(f"~{site['time_left_s']:.0f} s left")
    last = site.get("last")
    if last:
        parts.append(f"({last['direction']} {last['bytes'] / 1e6:.1f} MB in "
                     f"{last['seconds']:.1f} s at {_mbit(last.get('rate_bytes_per_s'))})")
    return " ".join(parts)
