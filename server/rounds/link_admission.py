"""Slow links at the round engine (issue 37.4, fedgpu/core/link_rates.py): which sites get the
round's model, which are asked for a compressed update, and why the others are left out.

Before a training round samples its sites, each site's measured link (the rates its node
reports with every poll and heartbeat, kept by name in the registry) and its last training time
give an estimate of the round trip; a site that cannot make the deadline is left out of the pool
(the job's `[transfer] slow_sites = "skip"`, the default) or, with `"compress"`, asked for an
int8 or top-k update sized to make it. The reason goes to the round record (`link` in `fedgpu
rounds --json`), the job's events (a log line naming the job) and the node's log (the message
of its next empty poll).

A compressed update from a site the job does not otherwise ask to compress is a delta from the
global model it was sent; it is turned back into whole weights here, so the strategy sees the
same kind of update from every site.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedgpu.core import codec
from fedgpu.core.job import Job
from fedgpu.core.link_rates import Admission, SlowSites, compressed_bytes, mbit, plan
from fedgpu.core.update_codecs import UpdateCodec, UpdateCodecError, decode_update, dense
from fedgpu.proto import pb
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.work import Spec, decode_payload
from fedgpu.server.transfer.spool import SpoolFile

log = logging.getLogger("fedgpu.server.rounds.link_admission")


class LinkAdmission:
    """One job's slow-link decisions: the last pool's (`skipped`, `asks`), kept until the
    next round is sorted, and what each site's log was last told."""

    def __init__(self, job: Job, registry: Registry, job_id: str = "") -> None:
        self.job, self.registry, self.job_id = job, registry, job_id
        self.mode = job.transfer.mode
        # node name -> why it was left out of the last pool sorted.
        self.skipped: dict[str, str] = {}
        # node id -> the codec it was asked for (only nodes asked for one).
        self.asks: dict[str, Admission] = {}
        self._logged: dict[str, str] = {}

    def applies(self, plan_kind: int, sends_model: bool) -> bool:
        """Training rounds that send the model, in modes where each site answers alone."""
        return (plan_kind == pb.TASK_KIND_TRAIN and sends_model
                and self.job.mode in ("star", "async"))

    def update_bytes(self, model_bytes: int) -> int:
        """What a site's update is expected to weigh: the model's bytes, or its job's codec's."""
        hetero = self.job.hetero
        return compressed_bytes(model_bytes, hetero.update_codec, hetero.topk_fraction)

    def sort(self, nodes: list[Node], model_bytes: int) -> list[Node]:
        """The nodes that may take this round's model; the others noted with their reason."""
        now = time.time()
        admitted: list[Node] = []
        skipped: dict[str, str] = {}
        asks: dict[str, Admission] = {}
        for node in nodes:
            verdict = plan(self.registry.link(node.name), model_bytes,
                           self.update_bytes(model_bytes), self.job.round_deadline_s,
                           self.mode, now)
            if not verdict.admit:
                skipped[node.name] = verdict.reason
                node.left_out = f"left out of this job's round: {verdict.reason}"
            else:
                admitted.append(node)
                node.left_out = None
                if verdict.codec is not None:
                    asks[node.node_id] = verdict
            said = verdict.reason
            if said and self._logged.get(node.name) != said:
                log.info("%s %s: %s", "skipping" if not verdict.admit else "slow link",
                         node.name, said, extra={"job_id": self.job_id})
            self._logged[node.name] = said
        self.skipped, self.asks = skipped, asks
        return admitted

    def forget(self) -> None:
        """The run ended: the sites it left out are no longer told so."""
        for node in self.registry.all():
            if node.name in self.skipped:
                node.left_out = None
        self.skipped, self.asks = {}, {}

    def hyperparameters(self, node: Node, hparams: dict[str, Any], run_id: str
                        ) -> dict[str, Any]:
        """The task's hyperparameters for `node`: with the codec it is asked for, if any (the
        node's runner takes these keys out: node/rounds/compress.py)."""
        ask = self.asks.get(node.node_id)
        if ask is None or ask.codec is None:
            return hparams
        out = {**hparams, "update_codec": ask.codec.value, "update_codec_run": run_id}
        if ask.codec is UpdateCodec.TOPK:
            out["topk_fraction"] = ask.topk_fraction
        else:
            out.pop("topk_fraction", None)
        return out

    def decode(self, node_id: str, kind: int, payload: bytes | bytearray | memoryview,
               spec: Spec | None, base: Callable[[], Mapping[str, np.ndarray]],
               spooled: SpoolFile | None = None,
               finite: codec.FiniteResult | None = None) -> Mapping[str, Any]:
        """An update's tensors. A site asked to compress (and only one) sends a compressed
        delta; in a job whose other sites send whole weights it becomes base + delta.
        `spooled`, `finite`: as for decode_payload (an update spilled to disk, the finite
        check taken as its bytes landed)."""
        ask = self.asks.get(node_id)
        if (ask is None or kind != pb.TASK_KIND_TRAIN or spec is None
                or self.job.hetero.update_codec is not UpdateCodec.NONE):
            return decode_payload(self.job, kind, payload, spec, spooled, finite)
        try:
            tensors, meta = codec.decode(payload)
            decoded = decode_update(tensors, meta, spec)
        except UpdateCodecError as exc:
            raise UpdateRejected(Reject.MALFORMED, f"compressed update refused (this site was "
                                 f"asked for {ask.codec} over its slow link): {exc}") from None
        except codec.CodecError as exc:
            raise UpdateRejected(Reject.MALFORMED,
                                 f"payload is not a valid tensor set: {exc}") from None
        weights = base()
        out: dict[str, np.ndarray] = {}
        for name, delta in decoded.items():
            b = np.asarray(weights[name])
            d = dense(delta)
            wide = np.int64 if b.dtype.kind in "iub" else np.float32
            out[name] = (b.astype(wide) + d.astype(wide)).astype(b.dtype)
        return out

    def record(self, participants: list[str]) -> dict[str, Any] | None:
        """The round record's `link`: sites left out and why, sites asked to compress, and the
        measured rates of the round's sites (those asked and those left out). None when none
        of them has a measured link."""
        rates = {}
        for name in sorted({*participants, *self.skipped}):
            link = self.registry.links.get(name)
            if link is not None and link.at:
                rates[name] = {**link.to_dict(),
                               "shown": f"down {mbit(link.down)}, up {mbit(link.up)}"}
        if not (rates or self.skipped or self.asks):
            return None
        names = {n.node_id: n.name for n in self.registry.all()}
        return {
            "slow_sites": self.mode.value,
            "skipped": [{"node": name, "reason": why} for name, why in self.skipped.items()],
            "compressed": [{"node": names.get(nid, nid), "codec": str(a.codec),
                            "topk_fraction": a.topk_fraction or None, "reason": a.reason}
                           for nid, a in self.asks.items()],
            "rates": rates,
        }


__all__ = ["LinkAdmission", "SlowSites"]
