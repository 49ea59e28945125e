"""Names and defaults that more than one part of fedgpu uses: each is defined here once.

Compose profiles, task kinds, partitions, modes, the node's status file and the
ring port are read by the node, the aggregator, the CLI and the tests; a copy elsewhere would
drift (it did: `fedgpu doctor` once refused the `ring` profile that `fedgpu up` took).
"""

from __future__ import annotations

from enum import StrEnum


class Profile(StrEnum):
    """The compose profiles (compose/compose.yaml) and their Kubernetes overlays."""

    CPU = "cpu"
    GPU_OFFERED = "gpu-offered"
    GPU_ENFORCED = "gpu-enforced"
    HETERO = "hetero"
    RING = "ring"


PROFILES: tuple[str, ...] = tuple(p.value for p in Profile)
# Profiles whose nodes never want a GPU: doctor skips the GPU checks for them.
CPU_PROFILES: frozenset[str] = frozenset({Profile.CPU, Profile.RING})


class TaskKind(StrEnum):
    """What a node is asked to do with a task (the wire's TaskKind, by name)."""

    INIT = "init"
    TRAIN = "train"
    EVALUATE = "evaluate"
    # mode = "statistics": the node summarises its data (fedgpu/core/fedstats/), no model.
    STATISTICS = "statistics"


TASK_KINDS: tuple[str, ...] = tuple(k.value for k in TaskKind)


class Partition(StrEnum):
    IID = "iid"
    DIRICHLET = "dirichlet"


PARTITIONS: tuple[str, ...] = tuple(p.value for p in Partition)


class Mode(StrEnum):
    """How a job trains: the aggregator averages (star) or the nodes gossip (ring)."""

    STAR = "star"
    RING = "ring"
    # FedBuff: nodes train on the model they have; each buffer of updates is one step.
    ASYNC = "async"
    # No training: one round in which every chosen site scores one given model.
    EVALUATE = "evaluate"
    # Federated statistics (fedgpu/core/fedstats/): one round, no model, no training.
    STATISTICS = "statistics"
    # After a training job: each site's last local model and the global one, scored on every
    # site's held-out split (a site x model matrix; server/rounds/cross_site.py).
    CROSS_SITE = "cross-site"


MODES: tuple[str, ...] = tuple(m.value for m in Mode)


class GpuNeed(StrEnum):
    """What a job asks of a node's GPU (the job file's `[resources] gpu`)."""

    REQUIRED = "required"    # a GPU that fits, or the node is ineligible
    PREFERRED = "preferred"  # a GPU that fits, else the CPU
    NONE = "none"            # never a GPU


GPU_NEEDS: tuple[str, ...] = tuple(g.value for g in GpuNeed)


class GpuMode(StrEnum):
    """A site's own GPU policy (the node's `--gpu`)."""

    NONE = "none"
    OFFER = "offer"
    ENFORCE = "enforce"


class RunState(StrEnum):
    """A run's lifecycle as `fedgpu status --json` reports it (`state`)."""

    WAITING = "waiting"   # for nodes, or for the initial model
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"     # `error` says why
    STOPPED = "stopped"   # the aggregator was stopped before the end


RUN_STATES: tuple[str, ...] = tuple(s.value for s in RunState)
# The states a run never leaves: `fedgpu status --watch` and `fedgpu run` stop following there.
RUN_ENDED: frozenset[str] = frozenset(
    {RunState.FINISHED, RunState.FAILED, RunState.STOPPED})


class RoundStatus(StrEnum):
    """How a closed round attempt ended (`status` in `fedgpu rounds --json`)."""

    FINISHED = "finished"
    RETRIED = "retried"   # too few updates, or no usable result: the round runs again


# Where `fedgpu node start` keeps its status file (FEDGPU_NODE_STATUS); the container
# HEALTHCHECK (`fedgpu node health`) and `fedgpu ps` read it.
NODE_STATUS_FILE = "/tmp/fedgpu-node-status.json"
# The TCP port a ring-mode node hosts its rendezvous on when it is rank 0 (torch's default).
DEFAULT_RING_PORT = 29500


class JobState(StrEnum):
    """A job's life on a federation that stays up (`fedgpu job list`)."""

    QUEUED = "queued"        # submitted; an earlier job runs
    WAITING = "waiting"      # its turn, but too few nodes can take it (the reason says why)
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"        # the error says why
    STOPPED = "stopped"      # `fedgpu job stop`


JOB_STATES: tuple[str, ...] = tuple(s.value for s in JobState)
ENDED_JOB_STATES: frozenset[JobState] = frozenset(
    {JobState.FINISHED, JobState.FAILED, JobState.STOPPED})


class Transport(StrEnum):
    """Which path carried a payload (`transport` in `fedgpu rounds --json` and `nodes --json`):
    the bulk port beside gRPC, or gRPC streaming (no bulk port, or the node cannot reach it)."""

    BULK = "bulk"
    GRPC = "grpc"


# Half-precision transfer of float32 weights (the job's `wire_dtype`): lossy, off by default.
WIRE_DTYPES: tuple[str, ...] = ("bf16", "fp16")


class TaskApproval(StrEnum):
    """Which code from the wire a node's site runs (`node start --task-approval`)."""

    INSTALLED = "installed"  # only tasks installed in the image (entry points)
    APPROVED = "approved"    # also bundles whose sha256 is on the site's allow-list
    ANY = "any"              # every bundle (local demos: `fedgpu run`)


TASK_APPROVALS: tuple[str, ...] = tuple(a.value for a in TaskApproval)


class BundleState(StrEnum):
    """A bundle at a site: on its allow-list or not (`fedgpu node tasks`), and, on the wire,
    whether that node can run it (`unusable`: e.g. a requirement it lacks)."""

    PENDING = "pending"      # seen (fetched with a job), not yet decided by the site
    APPROVED = "approved"
    REJECTED = "rejected"
    UNUSABLE = "unusable"


BUNDLE_STATES: tuple[str, ...] = tuple(s.value for s in BundleState)


# The tasks every node installs with fedgpu (node/tasks/__init__.py, checked by a test): the
# aggregator, which imports no node code, knows these names before any node has registered.
BUILTIN_TASKS: tuple[str, ...] = ("causal-lm", "digits", "images")
