"""The aggregator's side of unlike sites (fedgpu/core/hetero_config.py): the time budget sent
with every task, each update handed to its strategy with what the strategy's table row asks
for (FedNova's local steps, FedBuff's staleness), and compressed updates (int8, top-k) checked
and decoded into block sources."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fedgpu.core import codec, local_params
from fedgpu.core.hetero_config import BUDGET_HPARAM, LocalWork
from fedgpu.core.job import Job
from fedgpu.core.job.strategies import UpdateNeed
from fedgpu.core.update_codecs import UpdateCodec, UpdateCodecError, decode_update
from fedgpu.proto import pb
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.paged import decode_paged
from fedgpu.server.rounds.validation import decode_and_check
from fedgpu.server.strategies.base import Strategy
from fedgpu.server.strategies.update import UpdateIn
from fedgpu.server.transfer.spool import SpoolFile

Spec = Mapping[str, tuple[str, tuple[int, ...]]]


def task_hyperparameters(job: Job, run_id: str = "") -> dict[str, Any]:
    """The hyperparameters every task header carries: the job's, plus the runner's own for
    unlike sites (node/rounds/runner.py takes them out before the task sees the rest): the
    time budget of a local_work = "time" job, the codec of an update_codec job (and the run
    its error-feedback residual belongs to)."""
    out: dict[str, Any] = dict(job.hyperparameters)
    if job.hetero.local_work is LocalWork.TIME:
        out[BUDGET_HPARAM] = job.hetero.round_train_s
    if job.hetero.update_codec is not UpdateCodec.NONE:
        out.update(update_codec=job.hetero.update_codec.value,
                   topk_fraction=job.hetero.topk_fraction, update_codec_run=run_id)
    if job.local_params:
        # The site keeps its copy of these tensors per run (node/rounds/local_state.py).
        out.update({local_params.HPARAM: list(job.local_params),
                    local_params.RUN_HPARAM: run_id})
    return out


def configure(strategy: Strategy, job: Job) -> None:
    """Tell the strategy its updates are deltas from the global model (an update codec)."""
    if job.hetero.update_codec is not UpdateCodec.NONE:
        strategy.deltas = True  # type: ignore[attr-defined]


def decode_payload(job: Job, kind: int, payload: bytes | bytearray | memoryview,
                   spec: Spec | None, spooled: SpoolFile | None = None,
                   finite: codec.FiniteResult | None = None) -> Mapping[str, Any]:
    """An update's tensors: compressed training updates as block sources (the digest and the
    size limit were checked on the compressed bytes as they arrived), anything else dense;
    `spooled`: the payload is that file's mapping, read one tensor at a time; `finite`: the
    finite check taken as the bytes landed (validation.decode_and_check)."""
    if (job.hetero.update_codec is UpdateCodec.NONE or kind != pb.TASK_KIND_TRAIN
            or spec is None):
        if spooled is not None:
            return decode_paged(memoryview(payload), spec, spooled.drop)
        return decode_and_check(payload, spec, finite)
    try:
        tensors, meta = codec.decode(payload)
        return decode_update(tensors, meta, spec)
    except UpdateCodecError as exc:
        raise UpdateRejected(Reject.MALFORMED, f"compressed update refused: {exc}") from None
    except codec.CodecError as exc:
        raise UpdateRejected(Reject.MALFORMED,
                             f"payload is not a valid tensor set: {exc}") from None


def update_in(strategy: Strategy, tensors: Mapping[str, Any], num_examples: int,
              train_metrics: Mapping[str, float], staleness: int = 0) -> UpdateIn:
    """The update as its strategy's table row asks for it: the local steps where it normalises
    by them (refused when the task did not report them), its staleness (model versions since
    its task) where it weighs by it."""
    needs = strategy.needs
    steps = None
    if UpdateNeed.LOCAL_STEPS in needs:
        steps = train_metrics.get("steps")
        if steps is None or not (math.isfinite(steps) and steps > 0):
            raise UpdateRejected(
                Reject.MALFORMED,
                f"strategy {strategy.name!r} needs the update's local steps (train metric "
                f"'steps' > 0), got {steps!r}: the task must report how many optimizer steps "
                f"it took")
    return UpdateIn(tensors, num_examples, local_steps=steps,
                    staleness=staleness if UpdateNeed.STALENESS in needs else 0)


Item = tuple[Mapping[str, Any], int, Mapping[str, float], int]


def sums_by_examples(strategy: Strategy) -> bool:
    """Does the strategy fold updates into one weighted sum by their examples alone (FedAvg
    and the server optimisers on its mean)? Such a fold takes several updates in one sweep,
    and refuses none that passed validation (its only input beyond the tensors, the example
    count, is checked positive with the header)."""
    return strategy.folds_many and strategy.needs == {UpdateNeed.EXAMPLES}


def fold_updates(strategy: Strategy, items: list[Item]) -> list[BaseException | None]:
    """Each (tensors, num_examples, train_metrics, staleness) into the strategy, what each one
    raised in its place. Several updates for a strategy that sums by examples go into its sum
    in one sweep: one pass over the sum for all of them instead of one each."""
    if len(items) > 1 and sums_by_examples(strategy):
        strategy.add_many([UpdateIn(tensors, n) for tensors, n, _, _ in items])
        return [None] * len(items)
    errors: list[BaseException | None] = []
    for tensors, n, metrics, staleness in items:
        try:
            strategy.add(update_in(strategy, tensors, n, metrics, staleness))
        except Exception as exc:  # noqa: BLE001 - this update's, not its neighbours'
            errors.append(exc)
        else:
            errors.append(None)
    return errors
