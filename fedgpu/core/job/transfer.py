"""The job file's `[transfer]`: what the aggregator does with sites on slow links (issue 37.4,
fedgpu/core/link_rates.py). A section of the job schema (registered in sections.py); the round
engine's link admission (server/rounds/link_admission.py) reads `TransferSettings`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.core.job.schema import key, keys_of, refuse_unknown
from fedgpu.core.link_rates import SlowSites

SLOW_SITES = tuple(m.value for m in SlowSites)


@dataclass(frozen=True)
class TransferSettings:
    """The job file's `[transfer]`: how slow links are handled."""

    slow_sites: str = key(
        SlowSites.SKIP.value, "A site whose measured link rate cannot download the model, "
        "train and upload its update before `round_deadline_s`: `skip` it (the round record "
        "says why: \"needs ~180 s at 2.1 Mbit/s, deadline 15 s\"), ask it for a `compress`ed "
        "update (int8, or top-k sized to make the deadline; not with secure aggregation or "
        "[privacy], which need whole updates; star mode only), or `try` it anyway. A site "
        "not measured yet is always tried. See "
        "[Slow links](../explanation/bulk-path.md#slow-links).",
        str, f"one of {', '.join(SLOW_SITES)}", choices=SLOW_SITES)

    @property
    def mode(self) -> SlowSites:
        return SlowSites(self.slow_sites)


def parse_transfer(raw: Mapping[str, Any], parsed: dict[str, Any],
                   source: str) -> TransferSettings:
    table = raw.get("transfer", {})
    if table is None:
        table = {}
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: 'transfer' must be a table ([transfer]), got {table!r}")
    refuse_unknown(table, [k.name for k in keys_of(TransferSettings)], source, "transfer")
    values = {k.name: k.read(table, source, "transfer.") for k in keys_of(TransferSettings)}
    settings = TransferSettings(**values)
    if settings.mode is SlowSites.COMPRESS and parsed["mode"] != "star":
        raise ConfigError(f"{source}: [transfer] slow_sites = \"compress\" is for star jobs: "
                          f"mode = {parsed['mode']!r} does not fold per-site updates the "
                          "aggregator could ask to be compressed")
    return settings
