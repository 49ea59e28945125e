"""Studies on the aggregator (server/studies.py) and how sampling reads them
(server/rounds/eligibility.py): a job of a study takes only the sites enrolled in it.

Threat model: an admin's mistake or a researcher's job file must not put a job on a site
outside its study (a site enrolled in one study trains only that study's jobs), and a typo in
a study's name must not silently run a job on every site once studies exist. Not covered: an
admin who enrols a site on purpose (the site's own policy, site_refuses_study, answers that).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fedgpu.core.errors import ConfigError
from fedgpu.core.job import Job, parse_job
from fedgpu.server import studies as studies_mod
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.eligibility import eligibility, eligible_nodes
from fedgpu.server.studies import Studies, StudyError


def _nodes(*names: str) -> Registry:
    registry = Registry()
    for name in names:
        node = registry.register(name, "peer", "0", {}, {}, {}, ["digits"])
        node.loop_seen = time.time()  # its task loop polls: eligible on every other count
    return registry


def test_studies_and_their_sites_survive_reopening(tmp_path: Path) -> None:
    store = Studies(tmp_path)
    assert not store.any() and store.unknown(["onco"]) == []  # labels until the first study
    store.create("onco", by="ada")
    store.enrol("onco", ["site-a", "site-b", "site-a"], by="ada")
    store.close()
    store = Studies(tmp_path)
    onco = store.get("onco")
    assert onco is not None and onco.sites == ("site-a", "site-b") and onco.created_by == "ada"
    assert store.unknown(["onco", "cardio"]) == ["cardio"]
    with pytest.raises(StudyError, match="exists"):
        store.create("onco")
    store.withdraw("onco", ["site-b"])
    assert store.get("onco").sites == ("site-a",)  # type: ignore[union-attr]
    with pytest.raises(StudyError, match="not enrolled"):
        store.withdraw("onco", ["site-b"])
    with pytest.raises(StudyError, match="no study 'cardio'"):
        store.enrol("cardio", ["site-a"])
    store.remove("onco")
    assert store.all() == [] and store.get("onco") is None
    store.close()


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "-lead", "ünï"])
def test_bad_study_names_are_refused_and_nothing_is_made(tmp_path: Path, bad: str) -> None:
    store = Studies(tmp_path)
    with pytest.raises(ConfigError):
        store.create(bad)
    assert store.all() == []
    # The job file's `study` key follows the same rule.
    with pytest.raises(ConfigError, match="study"):
        parse_job({"task": "digits", "study": bad})


def test_enrolment_is_bounded_and_refuses_unprintable_site_names(tmp_path: Path) -> None:
    store = Studies(tmp_path)
    store.create("onco")
    with pytest.raises(StudyError, match="at least one"):
        store.enrol("onco", [])
    with pytest.raises(StudyError, match="printable"):
        store.enrol("onco", ["site\nforged log line"])
    with pytest.raises(StudyError, match="at most"):
        store.enrol("onco", [f"s{i}" for i in range(studies_mod.MAX_SITES_PER_CALL + 1)])
    assert store.get("onco").sites == ()  # type: ignore[union-attr]


def test_a_job_of_a_study_samples_only_its_enrolled_sites(tmp_path: Path) -> None:
    registry = _nodes("site-a", "site-b", "site-c")
    store = Studies(tmp_path)
    onco = parse_job({"task": "digits", "study": "onco"})
    plain = Job(task="digits")
    alive = registry.alive()
    # No study yet: `study` is a label, every site may be sampled (as before studies).
    assert len(eligible_nodes(onco, alive, None, store)) == 3
    store.create("onco")
    store.enrol("onco", ["site-a", "site-c"])
    assert [n.name for n in eligible_nodes(onco, alive, None, store)] == ["site-a", "site-c"]
    site_b = next(n for n in alive if n.name == "site-b")
    assert eligibility(onco, site_b, True, None, store) == "not enrolled in study 'onco'"
    # Outside its study comes first, even for a site that is also lost.
    assert eligibility(onco, site_b, False, None, store) == "not enrolled in study 'onco'"
    # A job naming no study takes every site; one naming a study that is not (or no longer)
    # there takes none and says why.
    assert len(eligible_nodes(plain, alive, None, store)) == 3
    cardio = parse_job({"task": "digits", "study": "cardio"})
    assert eligible_nodes(cardio, alive, None, store) == []
    assert "does not exist" in (eligibility(cardio, site_b, True, None, store) or "")
    store.withdraw("onco", ["site-c"])
    assert [n.name for n in eligible_nodes(onco, alive, None, store)] == ["site-a"]


def test_a_site_whose_policy_refuses_the_study_is_neither_enrolled_nor_sampled(
        tmp_path: Path) -> None:
    # site-b advertised a policy that serves study cardio only (fedgpu/core/site_policy.py).
    from fedgpu.core import site_policy

    registry = _nodes("site-a", "site-b")
    store = Studies(tmp_path)
    store.create("onco")
    store.enrol("onco", ["site-a", "site-b"])
    nodes = {n.name: n for n in registry.all()}
    nodes["site-b"].site_policy = site_policy.parse('studies = ["cardio"]\n')
    onco = parse_job({"task": "digits", "study": "onco"})
    assert [n.name for n in eligible_nodes(onco, registry.alive(), None, store)] == ["site-a"]
    store.create("cardio")
    store.create("derm")
    with pytest.raises(StudyError, match="site-b.*serves 'cardio', not study 'derm'"):
        store.enrol("derm", ["site-a", "site-b"], nodes=nodes)
    store.enrol("cardio", ["site-a", "site-b"], nodes=nodes)
    assert store.get("cardio").sites == ("site-a", "site-b")  # type: ignore[union-attr]
    assert store.get("derm").sites == ()  # type: ignore[union-attr]  # all or none
