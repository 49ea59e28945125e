"""The ranges a job file's numbers must stay in: what the wire, SQLite and the aggregator's
memory can hold, checked before any other use of the file.

An operator is trusted to run jobs, not to break the aggregator: `seed = 10**13` overflowed
the int64 seed of a task once multiplied, `rounds = 10**20` failed inside SQLite, and
`min_nodes = 30000` made a 6.9 GB mixing matrix. Every integer of a job file (top-level keys,
`[resources]`, `[strategy_params]`, `[hyperparameters]`) is refused here, naming its key and
its range, when it would not fit where it goes; so is a deadline past any meaningful wait.
Each key declares its range (`bound`) where it is declared (fedgpu/core/job/job.py); the
parse loop then checks what each key means (positive, >= min_nodes...).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fedgpu.core.errors import ConfigError

INT32_MAX = (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Far more nodes than one aggregator's registry holds (its --max-nodes defaults to 10,000):
# a job asking for more could never start.
MAX_JOB_NODES = 1_000_000
# A ring job's mixing matrix is min_nodes^2 float64 (8 MiB at this size), built for ring jobs
# only; a D-PSGD ring of more nodes than this gossips too slowly to be worth running.
MAX_RING_NODES = 1024
# Any wait a job names (a round's deadline, a ring exchange): thirty days is past any round
# anyone means, and keeps time arithmetic far from overflow.
MAX_WAIT_S = 30 * 24 * 3600.0
# Retries of a failed round: each is a full deadline's wait.
MAX_ROUND_RETRIES = 1000

# Tables of free-form scalars: their integers travel as JSON to the nodes and sit in SQLite.
SCALAR_TABLES = ("strategy_params", "hyperparameters")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range_error(source: str, key: str, lo: float, hi: float, value: object) -> ConfigError:
    if isinstance(value, int) and abs(value) > 10**40:
        # Not str(value): past 4,300 digits that raises, and it would echo them all.
        shown = f"a number of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    else:
        shown = str(value)
    return ConfigError(f"{source}: '{key}' must be from {lo:,} to {hi:,}, got {shown}")


def check_bounds(raw: dict[str, Any], source: str, keys: Iterable[Any]) -> None:
    """ConfigError naming the first number of `raw` (a parsed job file) out of its range.
    `keys`: the job's top-level keys (schema.Key), each with the `bound` it declares.
    Values of the wrong type are left to the parse loop, which names what each key must be."""
    for k in keys:
        if k.bound is None:
            continue
        lo, hi = k.bound
        value = raw.get(k.name)
        # Too small for its meaning (rounds = 0) is the key's own check; too large for the
        # wire, here.
        if k.kind is int and _is_int(value) and (value > hi or value < INT64_MIN):
            raise _range_error(source, k.name, lo, hi, value)
        if (k.kind is float and isinstance(value, int | float) and not isinstance(value, bool)
                and value > hi):
            raise _range_error(source, k.name, lo, hi, value)
    for table in (*SCALAR_TABLES, "resources"):
        entries = raw.get(table)
        if not isinstance(entries, dict):
            continue
        for name, value in entries.items():
            if _is_int(value) and not INT64_MIN <= value <= INT64_MAX:
                raise _range_error(source, f"{table}.{name}", INT64_MIN, INT64_MAX, value)
    if raw.get("mode") == "ring":
        nodes = raw.get("min_nodes", 1)
        if _is_int(nodes) and nodes > MAX_RING_NODES:
            raise ConfigError(f"{source}: 'min_nodes' of a ring job must be from 1 to "
                              f"{MAX_RING_NODES} (its mixing matrix is min_nodes^2), got "
                              f"{nodes}")


def derived_seed(seed: int, number: int, attempt: int) -> int:
    """A round attempt's seed from the job's: spread apart per round and attempt, and folded
    into the int64 the wire carries (unchanged for any seed that already fits after the
    spreading, so old runs keep their seeds)."""
    value = seed * 1_000_003 + number * 1009 + attempt
    return ((value - INT64_MIN) % (1 << 64)) + INT64_MIN
