"""The job file's `[statistics]` table, for `mode = "statistics"` (a section of the job
schema, registered in fedgpu/core/job/sections.py).

```toml
mode = "statistics"
[statistics]
min_count = 10       # cells (and columns) with fewer records are held back on the site
noise = "laplace"    # "none" (default) | "laplace" | "gaussian"
epsilon = 1.0        # each site's whole release (release.py says how it is split)
delta = 1e-5         # gaussian only
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.core.fedstats.release import MAX_MIN_COUNT, NOISES, Noise, ReleaseSettings
from fedgpu.core.job.schema import key, keys_of, refuse_unknown


@dataclass(frozen=True)
class JobStatistics:
    """How each site releases its statistics (see [Federated statistics]
    (../how-to/statistics.md))."""

    min_count: int = key(
        10, "A column or histogram cell with fewer records than this is held back on the "
        "site, never sent.", int, f"an integer from 1 to {MAX_MIN_COUNT}", lo=1,
        hi=MAX_MIN_COUNT, travels=True)
    noise: str = key(
        "none", "Differential-privacy noise on each site's released numbers: `none`, "
        "`laplace` or `gaussian`.", str, f"one of {', '.join(NOISES)}", choices=NOISES,
        travels=True)
    epsilon: float = key(
        1.0, "Each site's privacy budget for its whole release (split evenly over its "
        "columns' count, sum, sum of squares and histogram).", float, "a number > 0",
        lo=0.0, lo_open=True, hi=1e6, travels=True)
    delta: float = key(
        1e-5, "Gaussian noise's delta.", float, "a number in (0, 1)", lo=0.0, lo_open=True,
        hi=1.0, hi_open=True, travels=True)

    def release(self) -> ReleaseSettings:
        return ReleaseSettings(min_count=self.min_count, noise=Noise(self.noise),
                               epsilon=self.epsilon, delta=self.delta)


def parse_statistics(raw: Mapping[str, Any], parsed: dict[str, Any],
                     source: str) -> JobStatistics | None:
    """`[statistics]` for a statistics job (defaults when absent); refused for another mode,
    and a statistics job with features that need a model (secure aggregation, [privacy])."""
    table = raw.get("statistics")
    if parsed["mode"] != "statistics":
        if table is not None:
            raise ConfigError(f"{source}: [statistics] needs mode = \"statistics\"")
        return None
    for section in ("secure_aggregation", "privacy"):
        if parsed.get(section) is not None:
            raise ConfigError(f"{source}: mode = \"statistics\" trains no model: drop "
                              f"[{section}] ([statistics] noise protects the release)")
    if raw.get("local_params"):
        raise ConfigError(f"{source}: mode = \"statistics\" has no model, so no personalised "
                          "layers: drop 'local_params'")
    # One round, no model: `rounds` must be 1 (its default is filled in), and the final
    # evaluation of a model is off.
    if "rounds" in raw and raw["rounds"] != 1:
        raise ConfigError(f"{source}: mode = \"statistics\" is one round: drop 'rounds' "
                          f"(got {raw['rounds']!r})")
    if raw.get("evaluate"):
        raise ConfigError(f"{source}: mode = \"statistics\" has no model to evaluate: drop "
                          "'evaluate'")
    parsed["rounds"], parsed["evaluate"] = 1, False
    table = {} if table is None else table
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: 'statistics' must be a table ([statistics]), got "
                          f"{table!r}")
    names = [k.name for k in keys_of(JobStatistics)]
    refuse_unknown(table, names, source, "statistics")
    values = {k.name: k.read(table, source, "statistics.") for k in keys_of(JobStatistics)}
    out = JobStatistics(**values)
    # Known now without the columns: even one column splits epsilon over 4 releases.
    try:
        out.release().check(columns=1)
    except ValueError as exc:
        raise ConfigError(f"{source}: [statistics] {exc}") from None
    return out
