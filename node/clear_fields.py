"""What a site sends in the clear when the job protects its update from the aggregator.

Under secure aggregation the aggregator must learn the sum of the sites' updates and nothing
about one site; under local or distributed differential privacy it must see nothing computed
from a site's data before the noise. Numbers a round worker reports (training loss, examples,
steps, examples per second, the loss per iteration, the update's norm before clipping) are
such facts, so they stay in the site's log and only what is on the allow-list below leaves:

- secure aggregation (with or without distributed DP): the share's noise std, which the
  aggregator checks is there (a masked input without noise must not enter a noised sum). The
  example count travels masked inside the vector as the weight; the header says 0. The
  training numbers and the evaluation of the received model travel masked after it
  (fedgpu/core/secagg/masked_metrics.py): the aggregator sees their sums only; under
  distributed DP the evaluation only.
- local DP: the noise std the site added, and DP-SGD's own (already private) accounting.

Central DP trusts the aggregator with the update itself: nothing is held back there. What a
header carries besides metrics (the GPU decision, resources; under local DP the evaluation of
the model the site received, on its held-out split) is not a statistic of the update: see
docs/explanation/secure-aggregation.md.
"""

from __future__ import annotations

import logging

from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node")

SECURE_AGGREGATION = frozenset({"ddp_noise_std"})
LOCAL_DP = frozenset({"ldp_noise_std", "dp_epsilon", "dp_epsilon_total", "dp_delta",
                      "dp_noise_multiplier", "update_bytes"})


def allowed(task: pb.TaskHeader) -> frozenset[str] | None:
    """The train metrics `task`'s answer may carry; None: no restriction (a plain job)."""
    if task.secagg_setup or task.HasField("privacy_distributed"):
        return SECURE_AGGREGATION
    if task.HasField("privacy_local"):
        return LOCAL_DP
    return None


def restrict(task: pb.TaskHeader, update: pb.UpdateHeader) -> list[str]:
    """Drop from `update` what may not leave the site for `task`; the names dropped (for the
    site's own log)."""
    keep = allowed(task)
    if keep is None:
        return []
    dropped = sorted(k for k in update.train_metrics if k not in keep)
    for k in dropped:
        del update.train_metrics[k]
    if len(update.iteration_loss):
        dropped.append("iteration_loss")
        del update.iteration_loss[:]
    if task.secagg_setup and (update.eval_metrics or update.num_eval_examples):
        # The site's evaluation of the model it received goes masked too (node/secagg.py).
        dropped.extend(f"eval {k}" for k in sorted(update.eval_metrics))
        update.eval_metrics.clear()
        update.num_eval_examples = 0
    return dropped


def log_kept(round_: int, values: dict[str, float], dropped: list[str]) -> None:
    """The site's own record of what it did not send."""
    if dropped:
        shown = ", ".join(f"{k} {values[k]:.6g}" for k in dropped if k in values)
        log.info("round %d: not sent in the clear (protected job): %s", round_,
                 shown or ", ".join(dropped))
