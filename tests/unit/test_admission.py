"""GPU-aware admission: the job file's [resources], the one rule both sides apply
(fedgpu/core/admission.py) in every cell of its table, the node's decision for a task
(node/policy.py decide_for_job) and the aggregator's eligibility, all on plain records."""

from __future__ import annotations

import pytest

from fedgpu.core import admission
from fedgpu.core.admission import GpuFree, SiteCapacity
from fedgpu.core.admission_wire import (
    capacity_from_wire,
    capacity_to_wire,
    resources_from_wire,
    resources_to_wire,
)
from fedgpu.core.constants import GpuMode, GpuNeed
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job, Resources, parse_job
from fedgpu.node.nvml import GpuRecord, NvmlSnapshot
from fedgpu.node.policy import Ineligible, capacity, decide_for_job, parse_gpu_flags
from fedgpu.proto import pb
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.eligibility import eligibility

# ---- the job file -------------------------------------------------------------------------


def test_resources_default_to_a_preferred_gpu_and_use_gpu_false_means_none() -> None:
    assert parse_job({"task": "d"}).resources == Resources(GpuNeed.PREFERRED, 0, None)
    job = parse_job({"task": "d", "use_gpu": False})
    assert job.resources.gpu is GpuNeed.NONE and job.use_gpu is False
    job = parse_job({"task": "d", "resources": {"gpu": "none"}})
    assert job.use_gpu is False and job.needs.gpu is GpuNeed.NONE
    job = parse_job({"task": "d", "use_gpu": True, "resources": {
        "gpu": "required", "min_gpu_free_mib": 20000, "gpu_memory_mib": 8000}})
    assert job.resources == Resources(GpuNeed.REQUIRED, 20000, 8000) and job.use_gpu
    # The parsed job as stored (to_dict) parses back to itself: resumed jobs keep their needs.
    assert parse_job(job.to_dict()) == job
    # A Job built in code with use_gpu = False needs no GPU whatever its resources say.
    assert Job(task="d", use_gpu=False).needs.gpu is GpuNeed.NONE


@pytest.mark.parametrize("raw, message", [
    ({"use_gpu": True, "resources": {"gpu": "none"}}, "'use_gpu' = true contradicts"),
    ({"use_gpu": False, "resources": {"gpu": "required"}}, "'use_gpu' = false contradicts"),
    ({"use_gpu": False, "resources": {"min_gpu_free_mib": 10}}, "min_gpu_free_mib asks"),
    ({"resources": {"gpu": "none", "gpu_memory_mib": 10}}, "gpu_memory_mib asks"),
    ({"resources": {"gpu": "sometimes"}}, "'resources.gpu' must be one of required"),
    ({"resources": {"gpu": True}}, "'resources.gpu' must be one of"),
    ({"resources": {"min_gpu_free_mib": -1}}, "'resources.min_gpu_free_mib'"),
    ({"resources": {"min_gpu_free_mib": 1.5}}, "'resources.min_gpu_free_mib'"),
    ({"resources": {"min_gpu_free_mib": 1 << 40}}, "'resources.min_gpu_free_mib'"),
    ({"resources": {"gpu_memory_mib": 0}}, "'resources.gpu_memory_mib'"),
    ({"resources": {"gpu_memory_mib": True}}, "'resources.gpu_memory_mib'"),
    ({"resources": {"gpus": 1}}, r"unknown key\(s\) in \[resources\]: gpus"),
    ({"resources": 4}, "'resources' must be a table"),
])
def test_bad_resources_are_refused_with_the_key_named(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_job({"task": "d", **raw}, "job.toml")


# ---- the rule -----------------------------------------------------------------------------

def site(mode: str, *free: int | None, min_free: int = 0, healthy: bool = True,
         nvml: bool = True) -> SiteCapacity:
    gpus = tuple(GpuFree(i, f"GPU-{i}", f, 16000, healthy) for i, f in enumerate(free))
    return SiteCapacity(GpuMode(mode), min_free, nvml, "ok" if nvml else "no libnvidia-ml",
                        gpus)


REQUIRED = Resources(GpuNeed.REQUIRED, 8000)
PREFERRED = Resources(GpuNeed.PREFERRED, 8000)
NONE = Resources(GpuNeed.NONE)


@pytest.mark.parametrize("mode, need, free, eligible", [
    ("none", REQUIRED, 12000, False),
    ("none", PREFERRED, 12000, True),
    ("none", NONE, 12000, True),
    ("offer", REQUIRED, 12000, True),
    ("offer", REQUIRED, 4000, False),
    ("offer", PREFERRED, 4000, True),      # trains on the CPU
    ("offer", NONE, 12000, True),
    ("enforce", REQUIRED, 12000, True),
    ("enforce", REQUIRED, 4000, False),
    ("enforce", PREFERRED, 12000, True),
    ("enforce", PREFERRED, 4000, False),   # the site trains on a GPU only
    ("enforce", NONE, 12000, False),       # the job never uses one
])
def test_every_cell_of_the_table(mode: str, need: Resources, free: int, eligible: bool) -> None:
    assert (admission.refusal(need, site(mode, free)) is None) is eligible


def test_a_refusal_names_the_figures() -> None:
    why = admission.refusal(REQUIRED, site("offer", 4000, 6000, None, min_free=1000))
    assert why is not None
    assert why.startswith('the job requires a GPU (gpu = "required") and no GPU has 8000 MiB')
    assert "job min_gpu_free_mib 8000, site --gpu-min-free-mib 1000" in why
    assert "GPU 0 4000 MiB free, GPU 1 6000 MiB free, GPU 2 free memory unknown" in why
    # The site's own minimum counts when it is the larger.
    why = admission.refusal(REQUIRED, site("offer", 9000, min_free=10000))
    assert why is not None and "no GPU has 10000 MiB free" in why
    assert "unhealthy" in (admission.refusal(REQUIRED, site("offer", 9000, healthy=False))
                           or "")
    assert "NVML is unavailable (no libnvidia-ml)" in (
        admission.refusal(REQUIRED, site("offer", nvml=False)) or "")
    assert "--gpu none" in (admission.refusal(REQUIRED, site("none")) or "")
    assert "--gpu enforce" in (admission.refusal(NONE, site("enforce", 9000)) or "")


def test_unknown_free_memory_fits_only_when_nobody_asks_for_any() -> None:
    assert admission.refusal(Resources(GpuNeed.REQUIRED), site("offer", None)) is None
    assert admission.refusal(REQUIRED, site("offer", None)) is not None


def test_the_cap_is_a_share_of_the_card_and_the_smaller_cap_wins() -> None:
    cap = Resources(GpuNeed.REQUIRED, gpu_memory_mib=4000)
    assert admission.memory_fraction(cap, 16000, None) == 0.25
    assert admission.memory_fraction(cap, 16000, 0.1) == 0.1
    assert admission.memory_fraction(cap, 2000, None) == 1.0
    assert admission.memory_fraction(cap, None, None) is None
    assert admission.memory_fraction(Resources(), 16000, 0.5) == 0.5


def test_the_wire_forms_round_trip() -> None:
    need = Resources(GpuNeed.REQUIRED, 5000, 7000)
    header = pb.TaskHeader(use_gpu=True, resources=resources_to_wire(need))
    assert resources_from_wire(header) == need
    # An aggregator that sends no [resources]: use_gpu alone decides.
    assert resources_from_wire(pb.TaskHeader(use_gpu=False)).gpu is GpuNeed.NONE
    assert resources_from_wire(pb.TaskHeader(use_gpu=True)).gpu is GpuNeed.PREFERRED
    with pytest.raises(ValueError, match="gpu = 'maybe'"):
        resources_from_wire(pb.TaskHeader(resources=pb.JobResources(gpu="maybe")))
    cap = site("enforce", 3000, None, min_free=100)
    assert capacity_from_wire(capacity_to_wire(cap)) == cap
    with pytest.raises(ValueError, match="gpu_mode"):
        capacity_from_wire(pb.NodeCapacity(gpu_mode="always"))


# ---- the node's decision for a task --------------------------------------------------------

def record(index: int, free: int, total: int = 16000) -> GpuRecord:
    return GpuRecord(index, f"GPU-{index:08x}", f"Test {index}", total, total - free, free, 0,
                     "8.0", (), True, "ok")


TWO = NvmlSnapshot(True, "NVML sees 2 GPUs", "550", "12.4", (record(0, 9000), record(1, 5000)))


def test_the_node_refuses_with_the_rule_and_picks_a_gpu_that_fits() -> None:
    offer = parse_gpu_flags("offer", "1", 0, None)
    with pytest.raises(Ineligible, match="no GPU has 12000 MiB free"):
        decide_for_job(TWO, offer, Resources(GpuNeed.REQUIRED, 12000))
    # --gpu-index 1 has too little for the job: the GPU that fits, with a warning.
    d = decide_for_job(TWO, offer, Resources(GpuNeed.REQUIRED, 8000))
    assert d.device == "cuda" and d.gpu_index == 0 and d.warnings
    assert "min_gpu_free_mib 8000" in d.reason
    # Preferred on an offering site with no GPU that fits: the CPU.
    d = decide_for_job(TWO, offer, Resources(GpuNeed.PREFERRED, 12000))
    assert d.device == "cpu" and "12000" in d.reason
    assert decide_for_job(TWO, offer, Resources(GpuNeed.NONE)).device == "cpu"


def test_the_jobs_cap_becomes_a_fraction_of_the_chosen_card() -> None:
    d = decide_for_job(TWO, parse_gpu_flags("offer", None, 0, None),
                       Resources(GpuNeed.REQUIRED, gpu_memory_mib=4000))
    assert d.memory_fraction == 0.25 and "4000" in d.reason
    d = decide_for_job(TWO, parse_gpu_flags("offer", None, 0, 0.1),
                       Resources(GpuNeed.REQUIRED, gpu_memory_mib=4000))
    assert d.memory_fraction == 0.1


def test_the_node_and_the_aggregator_agree() -> None:
    """The aggregator's view of a node (its reported capacity) gives the node's own answer."""
    registry = Registry()
    node = registry.register("site", "peer", "0", {}, {}, {}, ["digits"])
    for mode in ("none", "offer", "enforce"):
        flags = parse_gpu_flags(mode, None, 1000, None)
        node.capacity = capacity_from_wire(capacity_to_wire(capacity(TWO, flags)))
        for need in (Resources(GpuNeed.REQUIRED, 8000), Resources(GpuNeed.REQUIRED, 9500),
                     Resources(GpuNeed.PREFERRED, 9500), Resources(GpuNeed.NONE)):
            job = Job(task="digits", resources=need, use_gpu=need.gpu is not GpuNeed.NONE)
            try:
                decide_for_job(TWO, flags, need)
                node_says = None
            except Ineligible as exc:
                node_says = str(exc)
            assert eligibility(job, node, True) == node_says, (mode, need)


def test_a_nodes_own_refusal_holds_until_it_reports_again() -> None:
    registry = Registry()
    node = registry.register("site", "peer", "0", {}, {}, {}, [])
    job = parse_job({"task": "digits", "resources": {"gpu": "required"}})
    assert eligibility(job, node, True) is None  # reports no capacity: it decides itself
    node.refusal = (job.needs, "GPU 0 is busy")
    assert eligibility(job, node, True) == "GPU 0 is busy"
    # Another job's needs are not what it refused.
    assert eligibility(parse_job({"task": "digits", "use_gpu": False}), node, True) is None
    registry.report_capacity(node, site("offer", 20000))
    assert node.refusal is None and eligibility(job, node, True) is None
    assert eligibility(job, node, False).startswith("lost since ")


def test_an_attempt_is_hopeless_once_an_ineligible_answer_leaves_too_few() -> None:
    import time

    from fedgpu.server.rounds.attempt import RoundState
    from fedgpu.server.rounds.records import Ineligibility
    from fedgpu.server.rounds.ring import block_error
    from fedgpu.server.rounds.states import SlotState

    registry = Registry()
    a, b, c = (registry.register(n, "peer", "0", {}, {}, {}, []) for n in ("a", "b", "c"))
    rnd = RoundState(number=3, kind=pb.TASK_KIND_TRAIN, attempt=1, required=2,
                     deadline=time.time() + 60, started=time.time())
    for n in (a, b, c):
        rnd.slots[n.node_id] = SlotState.ASSIGNED
    assert not rnd.hopeless()
    rnd.ineligible.append(Ineligibility(a.node_id, a.name, "GPU 0 is full"))
    rnd.settle(a.node_id, SlotState.INELIGIBLE, time.time())
    assert not rnd.hopeless()  # b and c may still make up min_nodes
    rnd.settle(b.node_id, SlotState.FAILED, time.time())
    assert rnd.hopeless()
    # A ring block lost to it names the node and its reason.
    assert "rank 0 (a)" in block_error(rnd, [a, b, c])
    assert "a: cannot take the job now: GPU 0 is full" in block_error(rnd, [a, b, c])
