"""Personalised layers (job key `local_params`): glob patterns over tensor names whose tensors
never leave a site.

One owner for the matching, used on both sides of the wire: the aggregator expects updates
without those names and aggregates only the rest (server/rounds/engine.py); the node keeps
its own copy of them across rounds and leaves them out of what it sends
(node/rounds/local_state.py). Patterns are `fnmatch` globs, case-sensitive, matched against
the whole name (`head.*`, `*.bn*`, `*running_mean`).

The aggregator's global model keeps the copies it started with (the initial model's values)
for local names: they are never updated, only sent to a site that has no copy of its own yet
(a site's first round, or a site that joins late), so every site starts from the same layers.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import TypeVar

from fedgpu.core.errors import ConfigError

# A job file is small; a pattern list this long is a mistake, not a model.
MAX_PATTERNS = 64
MAX_PATTERN_CHARS = 256
# The runner's hyperparameters that carry the patterns and the run the site's copy belongs to
# (the aggregator adds them to every task; the runner takes them out before the task sees
# the rest).
HPARAM = "local_params"
RUN_HPARAM = "local_params_run"

# BatchNorm's tensors in torch's naming (`bn1.weight`, `layer1.0.bn2.running_var`,
# `features.1.num_batches_tracked`): the FedBN preset (Li et al., 2021) keeps normalisation
# statistics and affine parameters at each site. Named `*bn*` or `*norm*` layers only: a
# model naming its BatchNorm otherwise lists its own patterns.
FEDBN = ("*bn*", "*.norm*", "*running_mean", "*running_var", "*num_batches_tracked")
PRESETS = {"fedbn": FEDBN}

V = TypeVar("V")


def parse(value: object, source: str = "job") -> tuple[str, ...]:
    """The job-file value as patterns: a list of globs, or a preset's name (`"fedbn"`);
    ConfigError naming what is wrong."""
    if isinstance(value, str):
        if value in PRESETS:
            return PRESETS[value]
        raise ConfigError(f"{source}: 'local_params' must be a list of glob patterns or one "
                          f"of {', '.join(repr(p) for p in PRESETS)}, got {value[:80]!r}")
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{source}: 'local_params' must be a list of glob patterns (e.g. "
                          f"[\"head.*\", \"*.bn*\"]), got {type(value).__name__}")
    if len(value) > MAX_PATTERNS:
        raise ConfigError(f"{source}: 'local_params' holds {len(value)} patterns; at most "
                          f"{MAX_PATTERNS}")
    out: list[str] = []
    for i, pattern in enumerate(value):
        if (not isinstance(pattern, str) or not pattern.strip() or not pattern.isprintable()
                or len(pattern) > MAX_PATTERN_CHARS):
            raise ConfigError(
                f"{source}: 'local_params[{i}]' must be a glob pattern of 1-"
                f"{MAX_PATTERN_CHARS} printable characters, got {str(pattern)[:80]!r}")
        if pattern not in out:
            out.append(pattern)
    return tuple(out)


@lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def is_local(name: str, patterns: Sequence[str]) -> bool:
    rx = _compiled(tuple(patterns))
    return rx is not None and rx.match(name) is not None


def split(tensors: Mapping[str, V], patterns: Sequence[str]
          ) -> tuple[dict[str, V], dict[str, V]]:
    """(shared, local): the tensors that travel and those that stay at the site."""
    shared: dict[str, V] = {}
    local: dict[str, V] = {}
    for name, value in tensors.items():
        (local if is_local(name, patterns) else shared)[name] = value
    return shared, local


def shared(tensors: Mapping[str, V], patterns: Sequence[str]) -> dict[str, V]:
    return split(tensors, patterns)[0] if patterns else dict(tensors)


def merged(model: Mapping[str, V], new: dict[str, V], patterns: Sequence[str]
           ) -> dict[str, V]:
    """An aggregate of the shared tensors completed with `model`'s local ones, in `model`'s
    order; `new` itself when nothing is local."""
    return {**model, **new} if patterns else new


def unmatched(patterns: Sequence[str], names: Iterable[str]) -> list[str]:
    """The patterns that match none of `names` (a typo would share what was meant to stay)."""
    names = list(names)
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]


def problem(patterns: Sequence[str], names: Iterable[str]) -> str | None:
    """Why these patterns cannot run on a model with these tensor names; None when they can."""
    names = list(names)
    missing = unmatched(patterns, names)
    if missing:
        sample = ", ".join(sorted(names)[:8])
        return (f"local_params pattern(s) {', '.join(repr(p) for p in missing)} match no "
                f"tensor of the model (its tensors: {sample}{', ...' if len(names) > 8 else ''})"
                ": fix the pattern, or remove it")
    if names and all(is_local(n, patterns) for n in names):
        return "local_params match every tensor of the model: nothing would be shared"
    return None
