"""May this node take this job now? One pure rule for both sides of the wire.

A node applies it at every task to its live NVML state (free memory now, not a start-up
snapshot) and answers "ineligible: <reason>" instead of training when it says no; the
aggregator applies it to what each node reported in its last heartbeat, so that a round samples
only nodes that will say yes, and a job that too few nodes can take waits with the reasons.
Being the same function, the two sides can differ only by how old the figures are.

The rule, for a job's `[resources] gpu` against a site's `--gpu`:

| site \\ job | required | preferred | none |
|---|---|---|---|
| none    | ineligible             | CPU                   | CPU        |
| offer   | a GPU that fits, else ineligible | a GPU that fits, else CPU | CPU |
| enforce | a GPU that fits, else ineligible | a GPU that fits, else ineligible | ineligible |

A GPU fits when it is healthy and has at least max(site --gpu-min-free-mib, job
min_gpu_free_mib) MiB free (unknown free memory fits only when neither asks for any).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fedgpu.core.constants import GpuMode, GpuNeed
from fedgpu.core.job.resources import Resources

# GPUs named in a reason; a host with more is summarised.
_SHOWN = 8


@dataclass(frozen=True)
class GpuFree:
    """One GPU as admission sees it."""

    index: int
    uuid: str
    free_mib: int | None
    total_mib: int | None
    healthy: bool


@dataclass(frozen=True)
class SiteCapacity:
    """A node's GPU policy and its GPUs' free memory at one moment."""

    mode: GpuMode
    min_free_mib: int
    nvml_available: bool
    nvml_reason: str
    gpus: tuple[GpuFree, ...]


def minimum_free(need: Resources, site: SiteCapacity) -> int:
    """The free memory a GPU must have now for this job on this site (MiB)."""
    return max(site.min_free_mib, need.min_gpu_free_mib)


def fits(gpu: GpuFree, minimum: int) -> bool:
    if not gpu.healthy:
        return False
    if gpu.free_mib is None:
        # Unknown free memory (NotSupported on unified-memory boards) cannot prove a minimum.
        return minimum == 0
    return gpu.free_mib >= minimum


def fitting(need: Resources, site: SiteCapacity) -> list[GpuFree]:
    minimum = minimum_free(need, site)
    return [g for g in site.gpus if fits(g, minimum)]


def refusal(need: Resources, site: SiteCapacity) -> str | None:
    """Why a node with `site` cannot take a job needing `need` now; None when it can."""
    if need.gpu is GpuNeed.NONE:
        if site.mode is GpuMode.ENFORCE:
            return ("the job uses no GPU (gpu = \"none\") and this site trains on a GPU only "
                    "(--gpu enforce)")
        return None
    if site.mode is GpuMode.NONE:
        if need.gpu is GpuNeed.REQUIRED:
            return "the job requires a GPU (gpu = \"required\"); this site offers none (--gpu none)"
        return None
    if fitting(need, site):
        return None
    if need.gpu is GpuNeed.PREFERRED and site.mode is GpuMode.OFFER:
        return None  # it trains on the CPU
    why = ("the job requires a GPU (gpu = \"required\")" if need.gpu is GpuNeed.REQUIRED
           else "this site trains on a GPU only (--gpu enforce)")
    return f"{why} and {no_fit(need, site)}"


def no_fit(need: Resources, site: SiteCapacity) -> str:
    """Why no GPU of the site fits the job, with the figures."""
    if not site.nvml_available:
        return f"NVML is unavailable ({site.nvml_reason})"
    if not site.gpus:
        return "NVML sees no GPU"
    minimum = minimum_free(need, site)
    asked = []
    if need.min_gpu_free_mib:
        asked.append(f"job min_gpu_free_mib {need.min_gpu_free_mib}")
    if site.min_free_mib:
        asked.append(f"site --gpu-min-free-mib {site.min_free_mib}")
    return (f"no GPU has {minimum} MiB free" + (f" ({', '.join(asked)})" if asked else "")
            + f": {_describe(site.gpus)}")


def _describe(gpus: Iterable[GpuFree]) -> str:
    parts = []
    listed = list(gpus)
    for g in listed[:_SHOWN]:
        if not g.healthy:
            parts.append(f"GPU {g.index} unhealthy")
        elif g.free_mib is None:
            parts.append(f"GPU {g.index} free memory unknown")
        else:
            parts.append(f"GPU {g.index} {g.free_mib} MiB free")
    if len(listed) > _SHOWN:
        parts.append(f"{len(listed) - _SHOWN} more")
    return ", ".join(parts)


def memory_fraction(need: Resources, total_mib: int | None,
                    site_fraction: float | None) -> float | None:
    """The cap on the round's process on a GPU of `total_mib`: the job's gpu_memory_mib as a
    share of the card, or the site's --gpu-memory-fraction, whichever is smaller; None when
    neither caps (or the card's size is unknown and only the job asks)."""
    job_fraction = None
    if need.gpu_memory_mib is not None and total_mib:
        job_fraction = min(1.0, need.gpu_memory_mib / total_mib)
    caps = [f for f in (site_fraction, job_fraction) if f is not None]
    # Rounded for the logs, never to 0 (a fraction must be positive).
    return max(round(min(caps), 6), 1e-6) if caps else None
