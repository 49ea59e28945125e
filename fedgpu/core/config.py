"""The job file (TOML): what the aggregator runs. Validated strictly so typos fail loudly."""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedgpu.core.constants import GPU_NEEDS, MODES, STRATEGIES, WIRE_DTYPES, GpuNeed
from fedgpu.core.errors import ConfigError
from fedgpu.core.hetero_config import KEYS as HETERO_KEYS
from fedgpu.core.hetero_config import HeteroWork, UpdateCodec, parse_hetero
from fedgpu.core.job_bounds import check_bounds
from fedgpu.core.privacy import PrivacySettings, parse_privacy
from fedgpu.core.privacy.settings import with_dp_rounds
from fedgpu.core.secagg import jobfile as secagg_jobfile
from fedgpu.core.secagg.noise_share import submit_problem

Scalar = int | float | str | bool
# A job file is a page of settings; anything larger is a mistake or an attack.
MAX_JOB_FILE_BYTES = 256 << 10
# Larger than any GPU made: a figure above it is a unit mistake (bytes, not MiB).
MAX_GPU_MIB = 16 << 20


@dataclass(frozen=True)
class Resources:
    """The job file's `[resources]`: what a node's GPU must offer for the job (checked by each
    node against its live NVML state at every task, and by the aggregator from heartbeats)."""

    gpu: GpuNeed = GpuNeed.PREFERRED
    # A GPU qualifies only with at least this much free memory now (besides the site's own
    # --gpu-min-free-mib; the larger of the two applies).
    min_gpu_free_mib: int = 0
    # A cap on the round's GPU memory, applied like --gpu-memory-fraction: the node turns it
    # into a fraction of the chosen GPU's total (the site's own fraction, if smaller, wins).
    gpu_memory_mib: int | None = None


@dataclass(frozen=True)
class Job:
    # The task's name: installed on the nodes, or the `name` of the bundle `task_dir` packs.
    task: str
    # A label for `fedgpu job list`; the task name when not given.
    name: str | None = None
    rounds: int = 5
    min_nodes: int = 1
    fraction: float = 1.0
    # Live nodes a round waits for before it samples (default min_nodes): with a pool of 100
    # and fraction 0.1, sampling must not start over the first 10 that happened to connect.
    min_available_nodes: int | None = None
    round_deadline_s: float = 600.0
    use_gpu: bool = True
    strategy: str = "fedavg"
    strategy_params: dict[str, Scalar] = field(default_factory=dict)
    hyperparameters: dict[str, Scalar] = field(default_factory=dict)
    seed: int = 0
    mode: str = "star"
    evaluate: bool = True
    # Retries of a round that closed at its deadline with fewer than min_nodes updates.
    round_retries: int = 3
    # A job that has not opened its first round this long after its turn came (too few nodes
    # can take it: its task, its bundle, its [resources]) fails with the reason, and the
    # queue moves on to the next job.
    queue_timeout_s: float = 600.0
    initial_weights: str | None = None
    # FedAvg weighs each update by the examples its node claims; no claim above this counts
    # (an update claiming more is refused). None: only each node's own stated size bounds it.
    max_examples_per_node: int | None = None
    # Ring mode (D-PSGD): `rounds` blocks share `iterations` gradient steps per node; nodes
    # gossip every `local_steps` steps with the weights of `mixing` ("uniform" ring or an
    # explicit min_nodes x min_nodes doubly stochastic matrix); every rendezvous and exchange
    # gives up after `ring_timeout_s`.
    mixing: str | list[list[float]] = "uniform"
    local_steps: int = 1
    iterations: int = 100
    ring_timeout_s: float = 60.0
    # "bf16" | "fp16": float32 weights travel in half precision both ways (half the bytes),
    # averaged in float32 on the aggregator. Lossy; None (the default): full precision.
    wire_dtype: str | None = None
    # `use_gpu` is the short form: false is `[resources] gpu = "none"`. parse_job keeps the two
    # in step; `needs` reads them together for a Job built in code.
    resources: Resources = field(default_factory=Resources)
    # A task bundle directory (docs: tutorials/own-task.md), relative to the job file: `fedgpu job
    # submit` packs it and sends it with the job. The aggregator keeps the bundle, not the path.
    task_dir: str | None = None
    # Secure aggregation (SecAgg+): `secure_aggregation = true` or a [secure_aggregation]
    # table (fedgpu/core/secagg/jobfile.py); None: off.
    secure_aggregation: secagg_jobfile.JobSecAgg | None = None
    # `[privacy]`: client-level differential privacy (fedgpu/core/privacy); None: none.
    privacy: PrivacySettings | None = None
    # Top-level keys for unlike sites (fedgpu/core/hetero_config.py): local_work,
    # round_train_s, update_codec, topk_fraction, and mode = "async"'s buffer keys.
    hetero: HeteroWork = field(default_factory=HeteroWork, metadata={"flat": True})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["hetero"]
        return {**out, **self.hetero.to_dict()}

    @property
    def needs(self) -> Resources:
        """What the job asks of a node's GPU, use_gpu = false included."""
        if self.use_gpu or self.resources.gpu is GpuNeed.NONE:
            return self.resources
        return Resources(gpu=GpuNeed.NONE)


def _fail(source: str, key: str, expected: str, value: object) -> ConfigError:
    return ConfigError(f"{source}: '{key}' must be {expected}, got {value!r}")


def _check_combinations(source: str, hetero: HeteroWork, secagg: Any, privacy: Any) -> None:
    """Features that each work alone but not together (yet): refused by name, so a job never
    runs with a guarantee silently missing. (Each one's own parser refuses mode = "async".)"""
    codec = hetero.update_codec if hetero.update_codec != UpdateCodec.NONE else None
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


def parse_job(raw: dict[str, Any], source: str = "job") -> Job:
    known = set(Job.__dataclass_fields__) - {"hetero"} | HETERO_KEYS
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
        )
    check_bounds(raw, source)  # every number fits where it goes (wire, SQLite, memory)
    task_dir = raw.get("task_dir")
    if task_dir is not None and not (isinstance(task_dir, str) and task_dir.strip()):
        raise _fail(source, "task_dir", "a directory (relative to the job file)", task_dir)
    if "task" not in raw and task_dir is None:
        raise ConfigError(f"{source}: 'task' is required (e.g. task = \"digits\"), or "
                          "'task_dir' naming a task bundle directory")

    def get(key: str, kind: type | tuple[type, ...], expected: str) -> Any:
        value = raw.get(key, Job.__dataclass_fields__[key].default)
        # bool is an int in Python; a job saying rounds = true is a mistake.
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise _fail(source, key, expected, value)
        if not isinstance(value, kind):
            raise _fail(source, key, expected, value)
        return value

    # With a bundle and no `task`, the task is named by the bundle's manifest (filled in when
    # the bundle is packed: `with_task`).
    task = get("task", str, "a task name") if "task" in raw else ""
    if "task" in raw and not _is_name(task):
        raise _fail(source, "task", "a task name (1-128 printable characters)", task)
    name = raw.get("name")
    if name is not None and not (isinstance(name, str) and _is_name(name)):
        raise _fail(source, "name", "1-128 printable characters", name)
    rounds = get("rounds", int, "a positive integer")
    if rounds < 1:
        raise _fail(source, "rounds", "a positive integer", rounds)
    min_nodes = get("min_nodes", int, "a positive integer")
    if min_nodes < 1:
        raise _fail(source, "min_nodes", "a positive integer", min_nodes)
    min_available = raw.get("min_available_nodes")
    if min_available is not None and (
        isinstance(min_available, bool) or not isinstance(min_available, int)
        or min_available < min_nodes
    ):
        raise _fail(source, "min_available_nodes", f"an integer >= min_nodes ({min_nodes})",
                    min_available)
    fraction = float(get("fraction", (int, float), "a number in (0, 1]"))
    if not 0.0 < fraction <= 1.0:
        raise _fail(source, "fraction", "a number in (0, 1]", fraction)
    deadline = float(get("round_deadline_s", (int, float), "a positive number of seconds"))
    if not (deadline > 0 and math.isfinite(deadline)):
        raise _fail(source, "round_deadline_s", "a positive number of seconds", deadline)
    use_gpu = get("use_gpu", bool, "true or false")
    # use_gpu = false alone means gpu = "none"; both given must agree.
    table = raw.get("resources")
    gpu_given = isinstance(table, dict) and "gpu" in table
    off = "use_gpu" in raw and not use_gpu
    resources = _resources(raw, source, GpuNeed.NONE if off else GpuNeed.PREFERRED)
    if "use_gpu" in raw and gpu_given and use_gpu != (resources.gpu is not GpuNeed.NONE):
        raise ConfigError(
            f"{source}: 'use_gpu' = {str(use_gpu).lower()} contradicts [resources] gpu = "
            f"{resources.gpu.value!r}: drop use_gpu (gpu = \"none\" is use_gpu = false)")
    use_gpu = resources.gpu is not GpuNeed.NONE
    evaluate = get("evaluate", bool, "true or false")
    strategy = get("strategy", str, f"one of {', '.join(STRATEGIES)}")
    if strategy not in STRATEGIES:
        raise _fail(source, "strategy", f"one of {', '.join(STRATEGIES)}", strategy)
    mode = get("mode", str, f"one of {', '.join(MODES)}")
    if mode not in MODES:
        raise _fail(source, "mode", f"one of {', '.join(MODES)}", mode)
    seed = get("seed", int, "an integer")
    queue_timeout = get("queue_timeout_s", (int, float), "a number of seconds > 0")
    if not queue_timeout > 0:
        raise _fail(source, "queue_timeout_s", "a number of seconds > 0", queue_timeout)
    retries = get("round_retries", int, "a non-negative integer")
    if retries < 0:
        raise _fail(source, "round_retries", "a non-negative integer", retries)
    initial = raw.get("initial_weights")
    if initial is not None and not isinstance(initial, str):
        raise _fail(source, "initial_weights", "a path to a .safetensors file", initial)
    max_examples = raw.get("max_examples_per_node")
    if max_examples is not None and (
        isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1
    ):
        raise _fail(source, "max_examples_per_node", "a positive integer", max_examples)
    ring = _ring_fields(raw, source, mode, rounds, min_nodes, fraction)
    wire_dtype = raw.get("wire_dtype")
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise _fail(source, "wire_dtype", f"one of {', '.join(WIRE_DTYPES)} (or absent: full "
                    "precision)", wire_dtype)
    if wire_dtype is not None and mode == "ring":
        raise _fail(source, "wire_dtype", "absent in ring mode (nodes average among "
                    "themselves in their own precision)", wire_dtype)
    secagg = secagg_jobfile.parse(raw.get("secure_aggregation"), source)
    secagg_jobfile.check_job(secagg, strategy, mode, min_nodes, source)
    privacy = None
    if raw.get("privacy") is not None:
        privacy = parse_privacy(raw["privacy"], source, strategy=strategy, job_mode=mode,
                                secure_aggregation=secagg is not None)
    hetero = parse_hetero(raw, source, mode=mode, strategy=strategy, deadline_s=deadline,
                          wire_dtype=wire_dtype, min_nodes=min_nodes)
    _check_combinations(source, hetero, secagg, privacy)
    return Job(
        task=task,
        name=name,
        rounds=rounds,
        min_nodes=min_nodes,
        fraction=fraction,
        min_available_nodes=min_available,
        round_deadline_s=deadline,
        use_gpu=use_gpu,
        strategy=strategy,
        strategy_params=_scalars(raw.get("strategy_params", {}), source, "strategy_params"),
        hyperparameters=with_dp_rounds(
            _scalars(raw.get("hyperparameters", {}), source, "hyperparameters"), rounds),
        seed=seed,
        mode=mode,
        evaluate=evaluate,
        round_retries=retries,
        queue_timeout_s=float(queue_timeout),
        initial_weights=initial,
        max_examples_per_node=max_examples,
        wire_dtype=wire_dtype,
        resources=resources,
        task_dir=task_dir,
        secure_aggregation=secagg,
        privacy=privacy,
        hetero=hetero,
        **ring,
    )


def _resources(raw: dict[str, Any], source: str, default: GpuNeed) -> Resources:
    """`[resources]`, strictly: unknown keys and impossible combinations are named."""
    table = raw.get("resources", {})
    if not isinstance(table, dict):
        raise _fail(source, "resources", "a table ([resources])", table)
    known = set(Resources.__dataclass_fields__)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) in [resources]: {', '.join(unknown)}; "
                          f"allowed: {', '.join(sorted(known))}")
    gpu = table.get("gpu", default.value)
    if gpu not in GPU_NEEDS:
        raise _fail(source, "resources.gpu", f"one of {', '.join(GPU_NEEDS)}", gpu)
    need = GpuNeed(gpu)
    min_free = table.get("min_gpu_free_mib", 0)
    if isinstance(min_free, bool) or not isinstance(min_free, int) or not (
            0 <= min_free <= MAX_GPU_MIB):
        raise _fail(source, "resources.min_gpu_free_mib",
                    f"a whole number of MiB from 0 to {MAX_GPU_MIB}", min_free)
    cap = table.get("gpu_memory_mib")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                            or not 0 < cap <= MAX_GPU_MIB):
        raise _fail(source, "resources.gpu_memory_mib",
                    f"a whole number of MiB from 1 to {MAX_GPU_MIB}", cap)
    if need is GpuNeed.NONE and (min_free or cap is not None):
        what = "min_gpu_free_mib" if min_free else "gpu_memory_mib"
        raise ConfigError(f"{source}: [resources] {what} asks something of a GPU, but the "
                          "job uses none (gpu = \"none\", or use_gpu = false)")
    return Resources(gpu=need, min_gpu_free_mib=min_free, gpu_memory_mib=cap)


def with_bundle_task(job: Job, bundle_name: str, source: str = "job") -> Job:
    """The job with its task named by its bundle's manifest; a `task` that names another task
    is refused (the job would wait for nodes that have neither)."""
    from dataclasses import replace

    if job.task and job.task != bundle_name:
        raise ConfigError(f"{source}: 'task' is {job.task!r} but the task bundle is named "
                          f"{bundle_name!r} (its fedgpu-task.toml): make them agree, or leave "
                          "'task' out")
    return replace(job, task=bundle_name)


def _ring_fields(raw: dict[str, Any], source: str, mode: str, rounds: int, min_nodes: int,
                 fraction: float) -> dict[str, Any]:
    from fedgpu.core import mixing as mx

    defaults = Job.__dataclass_fields__
    out: dict[str, Any] = {}
    for key in ("local_steps", "iterations"):
        value = raw.get(key, defaults[key].default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _fail(source, key, "a positive integer", value)
        out[key] = value
    timeout = raw.get("ring_timeout_s", defaults["ring_timeout_s"].default)
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or not (math.isfinite(timeout) and timeout > 0)):
        raise _fail(source, "ring_timeout_s", "a positive number of seconds", timeout)
    out["ring_timeout_s"] = float(timeout)
    mixing = raw.get("mixing", "uniform")
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
    out["mixing"] = mixing if isinstance(mixing, str) or w is None else w.tolist()
    if mode == "ring":
        if out["iterations"] < rounds:
            raise _fail(source, "iterations", f"at least rounds ({rounds}): each round is a "
                        "block of iterations", out["iterations"])
        if fraction != 1.0:
            raise _fail(source, "fraction", "1.0 in ring mode (every node of the ring trains "
                        "every iteration)", fraction)
    return out


def _is_name(text: str) -> bool:
    # Names end up in logs and tables: no control characters that could forge a line.
    return 0 < len(text.strip()) and len(text) <= 128 and text.isprintable()


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


def load_job(path: Path) -> Job:
    try:
        if path.stat().st_size > MAX_JOB_FILE_BYTES:
            raise ConfigError(f"job file {path} is larger than {MAX_JOB_FILE_BYTES} bytes")
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"job file {path} does not exist (see examples/job.toml)") from None
    except OSError as exc:
        raise ConfigError(f"cannot read job file {path}: {exc.strerror}") from None
    return parse_job(loads_toml(text, str(path)), str(path))


def loads_toml(text: str, source: str = "job") -> dict[str, Any]:
    """A job file's TOML, or ConfigError: nesting too deep for the parser (tomllib recurses)
    is a refusal like any syntax error, never a crash of the caller."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid TOML: tables or arrays nested too deep") \
            from None
    except ValueError as exc:  # tomllib lets int()'s own refusals through (4,300+ digits)
        raise ConfigError(f"{source}: not valid TOML: {str(exc)[:200]}") from None
