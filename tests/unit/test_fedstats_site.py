"""Federated statistics on the site and in the job file, in-process: the `[statistics]` table
and what it refuses; a statistics round through the runner for the packaged tasks (digits,
images: no model built); the statistics() hook contract and its refusal; the agent's release
(held-back cells absent from what is sent, a release the settings refuse reported as a failure
with the reason).

Threat model: docs/explanation/federated-statistics.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedgpu.core.datasets import TRAIN_FILE, split_digits
from fedgpu.core.errors import ConfigError
from fedgpu.core.fedstats.columns import ColumnSpec
from fedgpu.core.job import parse_job
from fedgpu.core.synth_images import synth_images
from fedgpu.node.data import read_split
from fedgpu.node.rounds import runner, site_statistics
from fedgpu.node.statistics_release import answer
from fedgpu.proto import pb

STATS = {"task": "digits", "mode": "statistics"}


def test_a_statistics_job_is_one_round_without_evaluation_and_with_defaults() -> None:
    job = parse_job(dict(STATS))
    assert (job.rounds, job.evaluate) == (1, False)
    assert job.statistics is not None and job.statistics.min_count == 10
    assert job.statistics.noise == "none"
    assert parse_job(job.to_dict()) == job  # stored and read back
    assert parse_job({"task": "digits"}).statistics is None


@pytest.mark.parametrize(("raw", "match"), [
    ({"task": "digits", "statistics": {}}, r"\[statistics\] needs mode = \"statistics\""),
    ({**STATS, "rounds": 3}, "is one round"),
    ({**STATS, "evaluate": True}, "no model to evaluate"),
    ({**STATS, "statistics": {"min_cnt": 3}}, "did you mean 'min_count'"),
    ({**STATS, "statistics": {"min_count": 0}}, "min_count"),
    ({**STATS, "statistics": {"noise": "cauchy"}}, "noise"),
    ({**STATS, "statistics": {"noise": "gaussian", "epsilon": 8.0}}, "epsilon < 1 per release"),
    ({**STATS, "statistics": {"epsilon": 0}}, "epsilon"),
])
def test_a_bad_statistics_job_is_refused_naming_the_key(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_job(raw)


def _spec(kind: str, task: str, data: Path, hp: dict[str, Any] | None = None) -> Any:
    return runner.parse_spec({"kind": kind, "task_name": task, "hyperparameters": hp or {},
                              "seed": 0, "round": 1, "data_dir": str(data), "device": "cpu",
                              "memory_fraction": None, "torch_threads": 1})


def test_digits_statistics_round_summarises_pixels_and_labels(tmp_path: Path) -> None:
    node = split_digits(tmp_path / "split", 3, seed=1)[0]
    result = runner.run_round(_spec("statistics", "digits", node), tmp_path)
    y = read_split(node, TRAIN_FILE)["y"]
    cols = {c["name"]: c for c in result.statistics or []}
    assert set(cols) == {"pixel", "label"} and result.num_examples == len(y)
    assert cols["label"]["count"] == len(y) and cols["pixel"]["per_record"] == 64
    assert cols["label"]["histogram"] == np.bincount(y, minlength=10).tolist()
    assert not (tmp_path / "weights.out.safetensors").exists()  # no model either way


def test_images_statistics_round_gives_colour_means_and_labels(tmp_path: Path) -> None:
    node = synth_images(tmp_path / "img", 1, classes=4, per_class=12, size=16, seed=1)[0]
    result = runner.run_round(_spec("statistics", "images", node,
                                    {"image_size": 16, "num_classes": 4}), tmp_path)
    cols = {c["name"]: c for c in result.statistics or []}
    assert set(cols) == {"red", "green", "blue", "label"}
    assert cols["label"]["bins"] == 4 and sum(cols["label"]["histogram"]) == cols["red"]["count"]
    assert all(0 <= cols[c]["sum"] / cols[c]["count"] + 127.5 <= 255 for c in ("red", "blue"))


class _NoHook:
    name = "nohook"


class _BadHook:
    name = "badhook"

    def statistics(self, data_dir: Path, hparams: Any) -> Any:
        return [("pixel", np.zeros(3))]


def test_a_task_without_the_hook_or_with_a_bad_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(site_statistics.NoStatisticsError, match="has no statistics\\(\\) hook"):
        site_statistics.summaries(_NoHook(), "nohook", tmp_path, {})
    with pytest.raises(site_statistics.NoStatisticsError, match="not a \\(ColumnSpec, values\\)"):
        site_statistics.summaries(_BadHook(), "badhook", tmp_path, {})


def _task(**release: Any) -> pb.TaskHeader:
    settings = {"min_count": 5, "noise": "none", "epsilon": 1.0, "delta": 1e-5, **release}
    return pb.TaskHeader(task_id="t", round=1, kind=pb.TASK_KIND_STATISTICS,
                         statistics=pb.StatisticsRelease(**settings))


class _Hook:
    def statistics(self, data_dir: Path, hparams: Any) -> list[tuple[ColumnSpec, np.ndarray]]:
        # 40 values in cell 0, 2 in cell 1 (under min_count 5), none in cell 2.
        return [(ColumnSpec("x", 0, 3, 3), np.array([0.5] * 40 + [1.5, 1.5]))]


def test_the_agent_sends_no_cell_under_min_count(tmp_path: Path) -> None:
    columns, _, _ = site_statistics.summaries(_Hook(), "hook", tmp_path, {})
    update = pb.UpdateHeader()
    assert answer(_task(), update, {"statistics": columns})
    sent = json.loads(update.statistics_json)["columns"][0]
    assert sent["histogram"] == [40.0, None, None] and sent["count"] == 42
    # With Laplace noise the count is no longer exact; the held-back cells stay absent.
    noisy = pb.UpdateHeader()
    assert answer(_task(noise="laplace", epsilon=0.5), noisy, {"statistics": columns})
    doc = json.loads(noisy.statistics_json)["columns"][0]
    assert doc["histogram"][1:] == [None, None] and doc["count"] != 42


@pytest.mark.parametrize("release", [{"noise": "gaussian", "epsilon": 8.0},
                                     {"min_count": 0}, {"noise": "cauchy"}])
def test_settings_the_site_cannot_apply_are_a_failure_with_the_reason(
        tmp_path: Path, release: dict[str, Any]) -> None:
    # The aggregator checks these at submit; a site checks again what it is told to do.
    columns, _, _ = site_statistics.summaries(_Hook(), "hook", tmp_path, {})
    update = pb.UpdateHeader()
    assert not answer(_task(**release), update, {"statistics": columns})
    assert update.failed and "statistics not released" in update.error
    assert not update.statistics_json


def test_causal_lm_statistics_round_counts_tokens_per_record(lm_data: Path,
                                                             tmp_path: Path) -> None:
    from fedgpu.node.tasks.causal_lm import adapters, corpus
    from fedgpu.node.tasks.causal_lm.settings import parse

    hp = {"model_dir": str(lm_data / "model"), "seq_len": 40}
    result = runner.run_round(_spec("statistics", "causal-lm", lm_data / "node-1", hp), tmp_path)
    (col,) = result.statistics or []
    s = parse(hp)
    train, _ = corpus.splits(lm_data / "node-1", s.eval_fraction)
    texts = corpus.TextDataset(train, adapters.load_tokenizer(s), s.seq_len, s.text_field)
    lengths = np.array([len(texts.tokenizer(texts.text(i))["input_ids"])
                        for i in range(len(texts))], dtype=np.float64)
    assert col["name"] == "tokens" and (col["lo"], col["hi"]) == (0.0, 40.0)
    assert col["count"] == len(train) == result.num_examples
    assert col["sum"] / col["count"] + 20.0 == pytest.approx(np.clip(lengths, 0, 40).mean())
