"""Typed node records (NVML snapshot, GPU decision) to and from their wire messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedgpu.node import clear_fields
from fedgpu.node.nvml import NvmlSnapshot
from fedgpu.node.policy import Decision
from fedgpu.proto import pb


def _num(value: int | None) -> int:
    return -1 if value is None else int(value)


def inventory(snap: NvmlSnapshot) -> pb.DeviceInventory:
    return pb.DeviceInventory(
        nvml_available=snap.available,
        nvml_reason=snap.reason,
        driver_version=snap.driver_version or "",
        cuda_driver_version=snap.cuda_driver_version or "",
        gpus=[
            pb.GpuInfo(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                memory_total_mib=_num(g.memory_total_mib),
                memory_used_mib=_num(g.memory_used_mib),
                memory_free_mib=_num(g.memory_free_mib),
                utilization_pct=_num(g.utilization_pct),
                compute_capability=g.compute_capability or "",
                healthy=g.healthy,
                reason=g.reason,
            )
            for g in snap.gpus
        ],
    )


def decision(d: Decision) -> pb.GpuDecision:
    return pb.GpuDecision(
        mode=d.mode,
        use_gpu=d.use_gpu,
        device=d.device,
        gpu_index=_num(d.gpu_index),
        gpu_uuid=d.gpu_uuid or "",
        gpu_name=d.gpu_name or "",
        memory_fraction=d.memory_fraction or 0.0,
        reason=d.reason,
        warnings=list(d.warnings),
    )


def resources(r: Mapping[str, Any]) -> pb.RoundResources:
    """A round's measured resources (node/rounds/process.py RoundOutcome.resources); -1: not
    measured."""
    def num(key: str) -> int:
        v = r.get(key)
        return -1 if v is None else int(v)

    return pb.RoundResources(
        device=r.get("device", ""),
        gpu_uuid=r.get("gpu_uuid", "") or "",
        nvml_used_before_mib=num("nvml_used_before_mib"),
        nvml_used_peak_mib=num("nvml_used_peak_mib"),
        nvml_used_after_mib=num("nvml_used_after_mib"),
        torch_peak_allocated_mib=num("torch_peak_allocated_mib"),
        torch_peak_reserved_mib=num("torch_peak_reserved_mib"),
        rss_peak_mib=num("rss_peak_mib"),
        train_seconds=float(r.get("train_seconds") or 0.0),
        round_seconds=float(r.get("round_seconds") or 0.0),
        queued_seconds=float(r.get("queued_seconds") or 0.0),
        devices=[pb.DeviceUse(
            rank=int(d.get("rank", 0)), device=str(d.get("device", "")),
            gpu_uuid=str(d.get("gpu_uuid") or ""),
            nvml_used_before_mib=_mib(d.get("nvml_used_before_mib")),
            nvml_used_peak_mib=_mib(d.get("nvml_used_peak_mib")),
            nvml_used_after_mib=_mib(d.get("nvml_used_after_mib")),
            train_seconds=float(d.get("train_seconds") or 0.0)) for d in r.get("devices", ())],
        # One device: its training time; data-parallel workers: the sum of theirs.
        device_seconds=float(r.get("device_seconds") or r.get("train_seconds") or 0.0),
    )


def _mib(v: object) -> int:
    return -1 if v is None else int(v)  # type: ignore[call-overload]


def update_header(task: pb.TaskHeader, node_id: str, gpu: Decision | None,
                  used: Mapping[str, Any] | None, result: Mapping[str, Any] | None,
                  error: str) -> pb.UpdateHeader:
    """The header of a node's answer to `task`: its result, or (result None) a failure."""
    update = pb.UpdateHeader(node_id=node_id, task_id=task.task_id, round=task.round,
                             kind=task.kind, evaluated_round=task.evaluated_round)
    if gpu is not None:
        update.decision.CopyFrom(decision(gpu))
    if used is not None:
        update.resources.CopyFrom(resources(used))
    if result is None:
        update.failed = True
        update.error = error
        return update
    update.num_examples = int(result.get("num_examples", 0))
    update.num_eval_examples = int(result.get("num_eval_examples", 0))
    update.train_metrics.update(_floats(result.get("train_metrics")))
    update.eval_metrics.update(_floats(result.get("eval_metrics")))
    update.iteration_loss.extend(float(v) for v in result.get("iteration_loss") or [])
    # A protected job (secure aggregation, local or distributed DP): only the allow-list
    # leaves the site in the clear; the rest goes to the site's own log.
    metrics = dict(update.train_metrics)
    clear_fields.log_kept(task.round, metrics, clear_fields.restrict(task, update))
    return update


def ineligible(task: pb.TaskHeader, node_id: str, reason: str) -> pb.UpdateHeader:
    """The answer to a task this node cannot take now, with the reason (kept short: the
    aggregator shows it per node in `fedgpu job status`)."""
    return pb.UpdateHeader(node_id=node_id, task_id=task.task_id, round=task.round,
                           kind=task.kind, evaluated_round=task.evaluated_round,
                           ineligible=True, ineligible_reason=reason[:1000])


def masked_values(result: Mapping[str, Any] | None) -> dict[str, float]:
    """A round result's numbers, before any allow-list, as secure aggregation masks them
    (fedgpu/core/secagg/masked_metrics.py): its train metrics, and its evaluation of the
    model it received as eval_loss, eval_accuracy and num_eval_examples."""
    result = result or {}
    out = _floats(result.get("train_metrics"))
    ev = _floats(result.get("eval_metrics"))
    for key in ("loss", "accuracy"):
        if key in ev:
            out[f"eval_{key}"] = ev[key]
    if ev and isinstance(result.get("num_eval_examples"), int | float):
        out["num_eval_examples"] = float(result["num_eval_examples"])
    return out


def _floats(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    return {str(k): float(v) for k, v in d.items() if isinstance(v, int | float)}
