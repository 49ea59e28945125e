"""The job: every key of a job file, declared once on the `Job` dataclass (and `Resources`),
and the one loop that parses a job file into it.

Each field declares its type, range, default, doc, resume rule and whether it travels to the
nodes (schema.key). Sections with parsers of their own (secure aggregation, privacy,
heterogeneous work, resources) register in sections.py; checks across keys are rules there
too. A new key is one field here (and, if it needs more than its range, one rule): see
docs/how-to/add-a-job-key.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from fedgpu.core import people
from fedgpu.core.constants import MODES, WIRE_DTYPES, GpuNeed
from fedgpu.core.errors import ConfigError
from fedgpu.core.fedstats.jobfile import JobStatistics
from fedgpu.core.hetero_config import HeteroWork
from fedgpu.core.job import eval_modes as _eval_modes
from fedgpu.core.job import schema
from fedgpu.core.job import sections as _sections
from fedgpu.core.job.resources import Resources
from fedgpu.core.job.schema import ANY, REQUIRED, TABLE, key
from fedgpu.core.job.strategies import JOB_STRATEGIES
from fedgpu.core.job.transfer import TransferSettings
from fedgpu.core.job_bounds import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_JOB_NODES,
    MAX_ROUND_RETRIES,
    MAX_WAIT_S,
    check_bounds,
)
from fedgpu.core.local_params import MAX_PATTERNS
from fedgpu.core.privacy import PrivacySettings
from fedgpu.core.secagg.jobfile import JobSecAgg

Scalar = int | float | str | bool


# The sections and rules are registered by importing them (sections.py, eval_modes.py).
assert _sections.registered and _eval_modes.registered


def is_name(text: str) -> bool:
    # Names end up in logs and tables: no control characters that could forge a line.
    return 0 < len(text.strip()) and len(text) <= 128 and text.isprintable()


def is_job_id(text: str) -> bool:
    return 0 < len(text) <= 64 and all(c.isalnum() or c in "-_" for c in text) and text.isascii()


def is_study_name(text: str) -> bool:
    return people.STUDY_NAME.match(text) is not None


def _section(name: str, default: Any) -> Any:
    if callable(default):
        return field(default_factory=default, metadata={"section": name})
    return field(default=default, metadata={"section": name})


@dataclass(frozen=True)
class Job:
    task: str = key(
        REQUIRED, "The task's name: installed on the nodes, or the `name` of the bundle "
        "`task_dir` packs.", str, "a task name (1-128 printable characters)", valid=is_name,
        resume=True, travels=True)
    name: str | None = key(
        None, "A label for `fedgpu job list`; the task name when not given.", str,
        "1-128 printable characters", optional=True, valid=is_name)
    rounds: int = key(
        5, "Training rounds (in ring mode: blocks of iterations).", int, "a positive integer",
        lo=1, bound=(1, INT32_MAX))  # TaskHeader.round is an int32
    min_nodes: int = key(
        1, "A round needs this many registered nodes that can take the job, and closes with "
        "at least this many updates (in ring mode: the ring's size).", int,
        "a positive integer", lo=1, bound=(1, MAX_JOB_NODES))
    fraction: float = key(
        1.0, "Share of the live, eligible nodes sampled each round (seeded, reproducible); "
        "must stay 1.0 in ring mode.", float, "a number in (0, 1]", lo=0.0, lo_open=True,
        hi=1.0)
    # With a pool of 100 and fraction 0.1, sampling must not start over the first 10 that
    # happened to connect.
    min_available_nodes: int | None = key(
        None, "Live nodes a round waits for before it samples (default min_nodes).", int,
        "an integer >= min_nodes", optional=True, bound=(1, MAX_JOB_NODES))
    round_deadline_s: float = key(
        600.0, "Stragglers past this many seconds are dropped from the round; too few "
        "updates by then and the round is retried.", float, "a positive number of seconds",
        lo=0.0, lo_open=True, bound=(0.0, MAX_WAIT_S))
    use_gpu: bool = key(
        True, "Short form of `[resources] gpu`: false is `gpu = \"none\"`; true leaves `gpu` "
        "at `\"preferred\"` unless `[resources]` says otherwise.", bool, "true or false",
        travels=True)
    strategy: str = key(
        "fedavg", "How updates are combined (see [strategies](#strategies)).", str,
        f"one of {', '.join(JOB_STRATEGIES)}", choices=JOB_STRATEGIES, resume=True)
    strategy_params: dict[str, Scalar] = key(
        {}, "The strategy's parameters (see [strategies](#strategies)).", TABLE, "a table",
        resume=True)
    hyperparameters: dict[str, Scalar] = key(
        {}, "Passed to the task as JSON (numbers, strings, booleans); the runner takes its "
        "own keys out first (see [the runner's hyperparameters]"
        "(tasks.md#the-runners-hyperparameters)).", TABLE, "a table", travels=True)
    seed: int = key(
        0, "Seeds the sampling of nodes and the task's initialisation.", int, "an integer",
        bound=(INT64_MIN, INT64_MAX), travels=True)  # TaskHeader.seed is an int64
    mode: str = key(
        "star", "`star` (the aggregator combines updates), `ring` (D-PSGD between the nodes; "
        "see [Train as a ring](../how-to/ring.md)) or `async` (FedBuff: a step per buffer of "
        "updates; see [Unlike sites](../how-to/heterogeneous-sites.md)), `evaluate` (no "
        "training: every site scores one model; see [Evaluate a model on every site]"
        "(../how-to/evaluate-a-model.md)), `statistics` (one round of per-site and combined "
        "statistics of the data, no model; see [Federated statistics]"
        "(../how-to/statistics.md)) or `cross-site` (no training: a training job's global "
        "model and each site's local model scored on every site; see [Cross-site evaluation]"
        "(../how-to/cross-site-evaluation.md)).", str,
        f"one of {', '.join(MODES)}", choices=MODES, resume=True, travels=True)
    evaluate: bool = key(
        True, "Federated evaluation of every global model on the nodes' held-out splits.",
        bool, "true or false")
    round_retries: int = key(
        3, "Retries of a round that closed at its deadline with fewer than min_nodes "
        "updates.", int, "a non-negative integer", lo=0, bound=(0, MAX_ROUND_RETRIES))
    queue_timeout_s: float = key(
        600.0, "A job that has not opened its first round this long after its turn came "
        "(too few nodes can take it: its task, its bundle, its [resources]) fails with the "
        "reason, and the queue moves on to the next job.", float, "a number of seconds > 0",
        lo=0.0, lo_open=True, bound=(0.0, MAX_WAIT_S))
    initial_weights: str | None = key(
        None, "A safetensors file to start from (relative to the job file; `fedgpu job "
        "submit` uploads it); else one node builds the task's initial model.", str,
        "a path to a .safetensors file", optional=True)
    max_examples_per_node: int | None = key(
        None, "FedAvg weighs each update by the examples its node claims; no claim above "
        "this counts (an update claiming more is refused). None: only each node's own stated "
        "size bounds it.", int, "a positive integer", optional=True, lo=1,
        bound=(1, INT64_MAX))  # UpdateHeader.num_examples is an int64
    mixing: str | list[list[float]] = key(
        "uniform", "Ring mode: `\"uniform\"` (left, self, right, 1/3 each) or an explicit "
        "`min_nodes` x `min_nodes` doubly stochastic matrix W (row r: rank r's weights).",
        ANY, "\"uniform\" or a matrix", travels=True)
    local_steps: int = key(
        1, "Ring mode: gradient steps between two gossip exchanges.", int,
        "a positive integer", lo=1, bound=(1, INT32_MAX), travels=True)
    iterations: int = key(
        100, "Ring mode: gradient steps per node in all, split evenly over `rounds` blocks.",
        int, "a positive integer", lo=1, bound=(1, INT64_MAX), travels=True)
    ring_timeout_s: float = key(
        60.0, "Ring mode: every rendezvous and every exchange gives up after this.", float,
        "a positive number of seconds", lo=0.0, lo_open=True, bound=(0.0, MAX_WAIT_S),
        travels=True)
    wire_dtype: str | None = key(
        None, "`\"bf16\"` or `\"fp16\"`: float32 weights travel in half precision both ways "
        "(half the bytes), averaged in float32 on the aggregator. Lossy; none (the default): "
        "full precision.", str, f"one of {', '.join(WIRE_DTYPES)} (or absent: full "
        "precision)", choices=WIRE_DTYPES, optional=True, travels=True)
    # `use_gpu` is the short form: false is `[resources] gpu = "none"`. The parse keeps the
    # two in step; `needs` reads them together for a Job built in code.
    resources: Resources = _section("resources", Resources)
    task_dir: str | None = key(
        None, "A task bundle directory, relative to the job file: `fedgpu job submit` packs "
        "it and sends it with the job (`--task-dir` wins). The aggregator keeps the bundle, "
        "not the path.", str, "a directory (relative to the job file)", optional=True,
        valid=lambda v: bool(v.strip()))
    secure_aggregation: JobSecAgg | None = _section("secure_aggregation", None)
    privacy: PrivacySettings | None = _section("privacy", None)
    hetero: HeteroWork = _section("hetero", HeteroWork)
    model_from_job: str | None = key(
        None, "`mode = \"evaluate\"`: score the final model of this earlier job (its id, "
        "from `fedgpu job list`) instead of `initial_weights`. `mode = \"cross-site\"` "
        "(required): the training job whose final model and sites' local models are "
        "compared.", str,
        "a job id (1-64 letters, digits, '-' or '_')", optional=True, valid=is_job_id)
    local_params: tuple[str, ...] = key(
        (), "Personalised layers: glob patterns over tensor names (`[\"head.*\", \"*.bn*\"]`) "
        "whose tensors never leave a site: updates leave them out, each site keeps its own "
        "across rounds in its state directory, and its evaluation uses them. `\"fedbn\"`: "
        "the BatchNorm tensors (FedBN). A pattern that matches no tensor fails the job at its "
        "first round. See [Personalised layers](../how-to/personalised-layers.md).", ANY,
        f"a list of at most {MAX_PATTERNS} glob patterns or \"fedbn\"",
        resume=True, travels=True)
    study: str | None = key(
        None, "The study the job belongs to: it samples only the sites enrolled in it "
        "(`fedgpu studies enrol`), and researchers act on the jobs of their own studies. "
        "Before any study is created it is a label only (every site is sampled).", str,
        "a study name (1-64 letters, digits, . _ @ -)", optional=True, valid=is_study_name)
    statistics: JobStatistics | None = _section("statistics", None)
    transfer: TransferSettings = _section("transfer", TransferSettings)

    def to_dict(self) -> dict[str, Any]:
        """The job as its stored JSON (job_json): every key; parse_job reads it back to an
        equal Job."""
        out = asdict(self)
        del out["hetero"]
        return {**out, **self.hetero.to_dict()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "job") -> Job:
        """A stored job (to_dict) back, through the same checks as a job file."""
        return parse_job(raw, source)

    @property
    def needs(self) -> Resources:
        """What the job asks of a node's GPU, use_gpu = false included."""
        if self.use_gpu or self.resources.gpu is GpuNeed.NONE:
            return self.resources
        return Resources(gpu=GpuNeed.NONE)


def top_keys() -> list[schema.Key]:
    """The job file's top-level keys (sections' flat keys excluded), in order."""
    return schema.keys_of(Job)


_eval_modes.declare_defaults(top_keys())


def known_top_level() -> set[str]:
    names = {k.name for k in top_keys()}
    for section in schema.SECTIONS.values():
        names |= set(section.flat_keys) if section.flat else {section.name}
    return names


def parse_job(raw: dict[str, Any], source: str = "job") -> Job:
    """A job file's table as a Job, or ConfigError naming the key (and the nearest known key
    for a typo). Unknown keys, then ranges, then each key, then the rules across keys, then
    each section, then the features that do not combine."""
    schema.refuse_unknown(raw, known_top_level(), source)
    keys = top_keys()
    check_bounds(raw, source, keys)  # every number fits where it goes (wire, SQLite, memory)
    parsed: dict[str, Any] = {k.name: k.read(raw, source) for k in keys}
    for check in schema.KEY_RULES:
        check(parsed, source)
    for name, section in schema.SECTIONS.items():
        parsed[name] = section.parse(raw, parsed, source)
    for check in schema.COMBINATION_RULES:
        check(parsed, source)
    return Job(**parsed)


def with_bundle_task(job: Job, bundle_name: str, source: str = "job") -> Job:
    """The job with its task named by its bundle's manifest; a `task` that names another task
    is refused (the job would wait for nodes that have neither)."""
    if job.task and job.task != bundle_name:
        raise ConfigError(f"{source}: 'task' is {job.task!r} but the task bundle is named "
                          f"{bundle_name!r} (its fedgpu-task.toml): make them agree, or leave "
                          "'task' out")
    return dataclasses.replace(job, task=bundle_name)


def for_submission(job: Job, bundle_name: str | None, source: str = "job") -> Job:
    """What the aggregator checks of a submitted job beyond its file: the task bundle that
    came with it names the task (`with_bundle_task`); a `task_dir` without a bundle is
    refused; a built-in task's `[hyperparameters]` are checked against the task's schema
    (fedgpu/core/task_schemas.py), as its nodes would."""
    from fedgpu.core import task_schemas

    if bundle_name is not None:
        return with_bundle_task(job, bundle_name, source)
    if job.task_dir is not None:
        raise ConfigError(f"{source}: 'task_dir' names a task bundle directory, but no "
                          "bundle came with the job: submit it with 'fedgpu job submit' "
                          "(which packs the directory and sends it)")
    task_schemas.check(job.task, job.hyperparameters, source)
    return job


def resume_keys() -> tuple[str, ...]:
    """The keys a resumed job must keep (declared `resume=True`)."""
    return tuple(k.name for k in top_keys() if k.resume) + tuple(
        s.name for s in schema.SECTIONS.values() if s.resume)
