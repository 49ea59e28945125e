"""One home per shared name: the compose profiles, `fedgpu up`, `fedgpu doctor` and the
strategy registry all agree with fedgpu.core.constants."""

from __future__ import annotations

import yaml

from fedgpu.cli.deploy import compose as deploy
from fedgpu.cli.doctor import checks as doctor
from fedgpu.core import constants
from fedgpu.core.job.strategies import JOB_STRATEGIES
from fedgpu.server.strategies import STRATEGIES
from tests.fixtures.federation import ROOT, cli


def compose_profiles() -> set[str]:
    doc = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())
    return {p for service in doc["services"].values() for p in service.get("profiles", [])}


def test_compose_up_and_doctor_accept_the_same_profiles() -> None:
    assert compose_profiles() == set(constants.PROFILES)
    for profile in constants.PROFILES:
        deploy.check_profile(profile)  # raises ConfigError when unknown
        doctor.gpu_severity(profile)


def test_doctor_accepts_the_ring_profile_on_the_command_line() -> None:
    r = cli("doctor", "--profile", "ring", "--json", token=None, timeout=120)
    assert "unknown profile" not in r.stderr, r.stderr
    assert r.returncode in (0, 1), r.stderr  # 1: a check failed on this host, not the flag


def test_unknown_profile_is_refused_by_both() -> None:
    for call in (lambda: deploy.check_profile("gpu"), lambda: doctor.gpu_severity("gpu")):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the type is checked below
            assert "unknown profile 'gpu'" in str(exc)
        else:
            raise AssertionError("an unknown profile was accepted")


def test_the_strategy_registry_and_the_job_parser_know_the_same_names() -> None:
    # The registry has a class for each row of the strategy table a job file may name, and
    # the job parser reads the same table.
    assert set(STRATEGIES) == set(JOB_STRATEGIES)
