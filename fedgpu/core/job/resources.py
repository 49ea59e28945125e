"""The job file's `[resources]`: what a node's GPU must offer for the job. A section of the job
schema (registered in sections.py); node/ and the aggregator's admission read `Resources`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedgpu.core.constants import GPU_NEEDS, GpuNeed
from fedgpu.core.errors import ConfigError
from fedgpu.core.job.schema import ANY, key, keys_of, refuse_unknown

# Larger than any GPU made: a figure above it is a unit mistake (bytes, not MiB).
MAX_GPU_MIB = 16 << 20
# Data-parallel workers on one site: no host has more devices; a larger figure is a typo.
MAX_WORKERS = 1024
ALL_WORKERS = "all"


@dataclass(frozen=True)
class Resources:
    """The job file's `[resources]`: what a node's GPU must offer for the job (checked by each
    node against its live NVML state at every task, and by the aggregator from heartbeats)."""

    gpu: GpuNeed = key(
        GpuNeed.PREFERRED, "`required`, `preferred` or `none` (see [GPU-aware admission]"
        "(../explanation/gpu-policy.md#gpu-aware-admission-resources)).", str,
        f"one of {', '.join(GPU_NEEDS)}", choices=GPU_NEEDS, travels=True)
    min_gpu_free_mib: int = key(
        0, "A GPU qualifies only with at least this much free memory now (besides the site's "
        "own --gpu-min-free-mib; the larger of the two applies).", int,
        f"a whole number of MiB from 0 to {MAX_GPU_MIB}", lo=0, hi=MAX_GPU_MIB, travels=True)
    gpu_memory_mib: int | None = key(
        None, "A cap on the round's GPU memory, applied like --gpu-memory-fraction: the node "
        "turns it into a fraction of the chosen GPU's total (the site's own fraction, if "
        "smaller, wins).", int, f"a whole number of MiB from 1 to {MAX_GPU_MIB}", lo=1,
        hi=MAX_GPU_MIB, optional=True, travels=True)
    workers: int | str = key(
        1, "Train each round data-parallel over this many of the site's devices (GPUs or MIG "
        "instances; one process each, torch.distributed DDP), or `\"all\"`: every usable one. "
        "On a CPU-only site the workers share the CPU (gloo).", ANY,
        f"a whole number from 1 to {MAX_WORKERS}, or \"all\"", travels=True)
    min_workers: int | None = key(
        None, "Under the site's `--gpu offer`, accept as few as this many devices when the "
        "site cannot give `workers` (unset: exactly `workers`, or refuse).", int,
        f"a whole number from 1 to {MAX_WORKERS}", lo=1, hi=MAX_WORKERS, optional=True,
        travels=True)

    @property
    def many_workers(self) -> bool:
        """More than one worker may train a round: the data-parallel path."""
        return self.workers != 1



def _fail(source: str, key: str, expected: str, value: object) -> ConfigError:
    return ConfigError(f"{source}: '{key}' must be {expected}, got {value!r}")


def parse_resources(raw: Mapping[str, Any], parsed: dict[str, Any], source: str) -> Resources:
    """`[resources]`, strictly; `use_gpu = false` alone means gpu = "none", both given must
    agree, and `use_gpu` follows the table."""
    table = raw.get("resources", {})
    if not isinstance(table, dict):
        raise _fail(source, "resources", "a table ([resources])", table)
    refuse_unknown(table, [k.name for k in keys_of(Resources)], source, "resources")
    use_gpu = parsed["use_gpu"]
    off = "use_gpu" in raw and not use_gpu
    values = {k.name: k.read(table, source, "resources.") for k in keys_of(Resources)}
    need = GpuNeed(table["gpu"]) if "gpu" in table else (
        GpuNeed.NONE if off else GpuNeed.PREFERRED)
    if need is GpuNeed.NONE and (values["min_gpu_free_mib"] or
                                 values["gpu_memory_mib"] is not None):
        what = "min_gpu_free_mib" if values["min_gpu_free_mib"] else "gpu_memory_mib"
        raise ConfigError(f"{source}: [resources] {what} asks something of a GPU, but the "
                          "job uses none (gpu = \"none\", or use_gpu = false)")
    if "use_gpu" in raw and "gpu" in table and use_gpu != (need is not GpuNeed.NONE):
        raise ConfigError(
            f"{source}: 'use_gpu' = {str(use_gpu).lower()} contradicts [resources] gpu = "
            f"{need.value!r}: drop use_gpu (gpu = \"none\" is use_gpu = false)")
    parsed["use_gpu"] = need is not GpuNeed.NONE
    workers = _workers(values["workers"], source)
    low = values["min_workers"]
    if low is not None and workers != ALL_WORKERS and low > workers:
        raise ConfigError(f"{source}: [resources] min_workers = {low} is more than workers = "
                          f"{workers}")
    return Resources(gpu=need, min_gpu_free_mib=values["min_gpu_free_mib"],
                     gpu_memory_mib=values["gpu_memory_mib"], workers=workers, min_workers=low)


def _workers(value: object, source: str) -> int | str:
    if value == ALL_WORKERS:
        return ALL_WORKERS
    # bool is an int in Python; `workers = true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORKERS:
        raise _fail(source, "resources.workers", f"a whole number from 1 to {MAX_WORKERS}, or "
                    '"all"', value)
    return value
