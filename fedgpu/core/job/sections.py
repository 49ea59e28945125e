"""The job's sections and the checks across its keys, registered into the schema.

Each section keeps its parser where its feature lives (secure aggregation:
fedgpu/core/secagg/jobfile.py, privacy: fedgpu/core/privacy/settings.py, heterogeneous work:
fedgpu/core/hetero_config.py); this module only says in which order they run and what each
gets of the keys parsed before it. What may combine with what is read from the strategy table
(fedgpu/core/job/strategies.py: secagg_problem, dp_ok, dense_only), never from name lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fedgpu.core import local_params
from fedgpu.core.errors import ConfigError
from fedgpu.core.fedstats.jobfile import JobStatistics, parse_statistics
from fedgpu.core.hetero_config import KEYS as HETERO_KEYS
from fedgpu.core.hetero_config import HeteroWork, UpdateCodec, parse_hetero
from fedgpu.core.job.resources import Resources, parse_resources
from fedgpu.core.job.schema import (
    Section,
    combination_rule,
    key_rule,
    register,
)
from fedgpu.core.job.strategies import strategy_spec
from fedgpu.core.job.transfer import TransferSettings, parse_transfer
from fedgpu.core.link_rates import SlowSites
from fedgpu.core.privacy import PrivacySettings, parse_privacy
from fedgpu.core.privacy.settings import with_dp_rounds
from fedgpu.core.secagg import jobfile as secagg_jobfile
from fedgpu.core.secagg.noise_share import submit_problem

Scalar = int | float | str | bool


def _fail(source: str, key: str, expected: str, value: object) -> ConfigError:
    return ConfigError(f"{source}: '{key}' must be {expected}, got {value!r}")


# ---- checks across top-level keys (before the sections) ---------------------------------


@key_rule
def _task(parsed: dict[str, Any], source: str) -> None:
    # With a bundle and no `task`, the task is named by the bundle's manifest (filled in when
    # the bundle is packed: `with_bundle_task`).
    if not parsed["task"] and parsed["task_dir"] is None:
        raise ConfigError(f"{source}: 'task' is required (e.g. task = \"digits\"), or "
                          "'task_dir' naming a task bundle directory")


@key_rule
def _min_available(parsed: dict[str, Any], source: str) -> None:
    value, least = parsed["min_available_nodes"], parsed["min_nodes"]
    if value is not None and value < least:
        raise _fail(source, "min_available_nodes", f"an integer >= min_nodes ({least})", value)


@key_rule
def _tables(parsed: dict[str, Any], source: str) -> None:
    for name in ("strategy_params", "hyperparameters"):
        parsed[name] = _scalars(parsed[name], source, name)
    # Refused now, naming the parameter (and the nearest one for a typo); the table is kept
    # as written, so a stored job and its checkpoint compare equal across versions.
    strategy_spec(parsed["strategy"], source).parse_params(parsed["strategy_params"], source)
    parsed["hyperparameters"] = with_dp_rounds(parsed["hyperparameters"], parsed["rounds"])


@key_rule
def _local_params(parsed: dict[str, Any], source: str) -> None:
    patterns = local_params.parse(parsed["local_params"], source)
    parsed["local_params"] = patterns
    if not patterns:
        return
    if parsed["mode"] == "ring":
        raise ConfigError(f"{source}: 'local_params' is for star and async jobs: in ring mode "
                          "the nodes average every tensor among themselves")
    taken = sorted({local_params.HPARAM, local_params.RUN_HPARAM} & set(parsed["hyperparameters"]))
    if taken:
        raise ConfigError(f"{source}: hyperparameter(s) {', '.join(taken)} are the runner's "
                          "own (they carry 'local_params' to the nodes): rename them")


@key_rule
def _ring(parsed: dict[str, Any], source: str) -> None:
    from fedgpu.core import mixing as mx

    mode, min_nodes, mixing = parsed["mode"], parsed["min_nodes"], parsed["mixing"]
    try:
        # A matrix given is checked whatever the mode, so it never sits unnoticed in a star
        # job (its size is bounded by the job file's); the uniform ring's min_nodes^2 matrix
        # is built for ring jobs only (check_bounds keeps their min_nodes small).
        if isinstance(mixing, str) and mode != "ring":
            if mixing != "uniform":
                raise mx.MixingError(f"{source}: 'mixing' must be \"uniform\" or an array of "
                                     f"{min_nodes} rows, got {mixing[:80]!r}")
            w = None
        else:
            w = mx.resolve(mixing, min_nodes, source)
    except mx.MixingError as exc:
        raise ConfigError(str(exc)) from None
    parsed["mixing"] = mixing if isinstance(mixing, str) or w is None else w.tolist()
    if mode == "ring":
        if parsed["iterations"] < parsed["rounds"]:
            raise _fail(source, "iterations", f"at least rounds ({parsed['rounds']}): each "
                        "round is a block of iterations", parsed["iterations"])
        if parsed["fraction"] != 1.0:
            raise _fail(source, "fraction", "1.0 in ring mode (every node of the ring trains "
                        "every iteration)", parsed["fraction"])
        if parsed["wire_dtype"] is not None:
            raise _fail(source, "wire_dtype", "absent in ring mode (nodes average among "
                        "themselves in their own precision)", parsed["wire_dtype"])


def _scalars(table: object, source: str, key: str) -> dict[str, Scalar]:
    if not isinstance(table, dict):
        raise _fail(source, key, "a table", table)
    for k, v in table.items():
        if not isinstance(v, int | float | str | bool):
            raise ConfigError(
                f"{source}: [{key}] {k} must be a number, string or boolean, got {v!r}"
            )
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{source}: [{key}] {k} must be finite, got {v!r}")
    return dict(table)


# ---- the sections, in the order they are parsed ----------------------------------------


def _secure_aggregation(raw: Mapping[str, Any], parsed: dict[str, Any],
                        source: str) -> secagg_jobfile.JobSecAgg | None:
    secagg = secagg_jobfile.parse(raw.get("secure_aggregation"), source)
    secagg_jobfile.check_job(secagg, parsed["strategy"], parsed["mode"], parsed["min_nodes"],
                             source)
    return secagg


def _privacy(raw: Mapping[str, Any], parsed: dict[str, Any],
             source: str) -> PrivacySettings | None:
    if raw.get("privacy") is None:
        return None
    return parse_privacy(raw["privacy"], source, strategy=parsed["strategy"],
                         job_mode=parsed["mode"],
                         secure_aggregation=parsed["secure_aggregation"] is not None)


def _hetero(raw: Mapping[str, Any], parsed: dict[str, Any], source: str) -> HeteroWork:
    return parse_hetero(raw, source, mode=parsed["mode"], strategy=parsed["strategy"],
                        deadline_s=parsed["round_deadline_s"], wire_dtype=parsed["wire_dtype"],
                        min_nodes=parsed["min_nodes"])


register(Section("resources", "What a node's GPU must offer for the job.", parse_resources,
                 Resources, travels=True))
register(Section("secure_aggregation", "SecAgg+ between the sites of a star job: "
                 "`secure_aggregation = true` or a table of settings (see [Secure "
                 "aggregation](../how-to/secure-aggregation.md)); absent: off.",
                 _secure_aggregation, secagg_jobfile.JobSecAgg, travels=True))
register(Section("privacy", "Client-level differential privacy: clipping, noise, the "
                 "accountant and a budget that ends the job (see [Train with differential "
                 "privacy](../how-to/differential-privacy.md)); absent: none.", _privacy,
                 PrivacySettings, travels=True))
register(Section("hetero", "Keys for unlike sites (time-budgeted work, compressed updates, "
                 "mode = \"async\"): top-level keys.", _hetero, HeteroWork,
                 flat_keys=HETERO_KEYS, travels=True))
register(Section("statistics", "`mode = \"statistics\"`: how each site releases its data's "
                 "statistics (see [Federated statistics](../how-to/statistics.md)); absent: "
                 "the defaults.", parse_statistics, JobStatistics, travels=True))
register(Section("transfer", "How the aggregator treats sites on slow links (see "
                 "[Slow links](../explanation/bulk-path.md#slow-links)).", parse_transfer,
                 TransferSettings))


# ---- features that each work alone but not together (yet) --------------------------------


@combination_rule
def _compress_slow_sites(parsed: dict[str, Any], source: str) -> None:
    """A compressed update is a lossy delta: what needs the whole vector cannot take it."""
    transfer: TransferSettings = parsed["transfer"]
    if transfer.mode is not SlowSites.COMPRESS:
        return
    if parsed["secure_aggregation"] is not None:
        raise ConfigError(f"{source}: [transfer] slow_sites = \"compress\" cannot be combined "
                          "with secure_aggregation: SecAgg+ masks and sums full update "
                          "vectors, which a compressed (int8 or top-k) update is not; use "
                          "slow_sites = \"skip\"")
    if parsed["privacy"] is not None:
        raise ConfigError(f"{source}: [transfer] slow_sites = \"compress\" cannot be combined "
                          "with [privacy], which clips and noises whole updates; use "
                          "slow_sites = \"skip\"")


@combination_rule
def _codec_with_whole_updates(parsed: dict[str, Any], source: str) -> None:
    """Refused by name, so a job never runs with a guarantee silently missing. (Each
    section's own parser refuses mode = "async".)"""
    hetero: HeteroWork = parsed["hetero"]
    codec = hetero.update_codec if hetero.update_codec != UpdateCodec.NONE else None
    secagg, privacy = parsed["secure_aggregation"], parsed["privacy"]
    if secagg is not None and codec:
        raise ConfigError(f"{source}: secure_aggregation masks whole updates; update_codec = "
                          f"{codec!r} cannot be combined with it")
    if privacy is not None and codec:
        raise ConfigError(f"{source}: [privacy] clips and noises whole updates; update_codec = "
                          f"{codec!r} cannot be combined with it")
    if secagg is not None and privacy is not None and privacy.mode == "distributed":
        why = submit_problem(secagg.settings.clip, secagg.settings.threshold,
                             privacy.clip_norm, privacy.noise_multiplier)
        if why is not None:
            raise ConfigError(f"{source}: {why}")


@combination_rule
def _workers_alone(parsed: dict[str, Any], source: str) -> None:
    """Data-parallel workers (node/rounds/ddp.py) train one model with DistributedDataParallel;
    Opacus' per-example clipping and ring mode's own worker processes are not wired to it."""
    resources: Resources = parsed["resources"]
    if not resources.many_workers:
        return
    given = parsed["resources"].workers
    if parsed["hyperparameters"].get("dp_sgd") is True:
        raise ConfigError(
            f"{source}: workers > 1 with DP-SGD (hyperparameter dp_sgd) is not supported: "
            f"[resources] workers = {given!r} trains with DistributedDataParallel, which this "
            "node's Opacus path does not wrap; drop workers or dp_sgd")
    if parsed["mode"] == "ring":
        raise ConfigError(f"{source}: workers > 1 with mode = \"ring\" is not supported: each "
                          f"ring rank is one process; drop [resources] workers = {given!r}")


# job.py imports this module for its registrations.
registered = True
