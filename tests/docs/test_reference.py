"""The generated reference pages say what the code says: every command of the typer app and
every key of the job file is on them, each key with a description."""

from __future__ import annotations

import re

import pytest

from tests.fixtures.doc_blocks import ROOT
from tools import cli_reference, docs_hooks, job_keys


def test_every_command_and_option_is_in_the_cli_reference() -> None:
    text = cli_reference.markdown()
    paths = [path for path, _ in cli_reference.commands()]
    assert {("job", "submit"), ("node", "approve"), ("certs", "init")} <= set(paths)
    for path, cmd in cli_reference.commands():
        assert f"{{#{cli_reference.anchor(path)}}}" in text, path
        for param in cmd.params:
            if not getattr(param, "hidden", False) and param.param_type_name == "option":
                assert all(opt in text for opt in param.opts), (path, param.opts)
    # Help records, as `--help` prints them: defaults and variables come from the options.
    section = text.split("{#fedgpu-server-start}")[1].split("\n## ")[0]
    assert "--port <int>" in section and "FEDGPU_PORT" in section and "50051" in section


def test_every_job_key_is_documented() -> None:
    """The reference is generated from the job schema: every key of every table is on it,
    each with its doc, and what a key declares (type, default, range, resume rule) is what
    the page says."""
    from fedgpu.core.job import Job, Resources
    from fedgpu.core.job.schema import SECTIONS

    tables = {name: cls for name, cls, _ in job_keys.tables()}
    assert tables[""] is Job and tables["resources"] is Resources
    assert {"secure_aggregation", "privacy"} <= set(tables)
    text = job_keys.markdown()
    for table, cls in tables.items():
        for key, _type, _default, _range, _resume, _travels, doc in job_keys.rows(cls):
            assert doc, (f"job key {table or 'top level'}.{key} has no doc: declare it with "
                         "schema.key(..., doc) or comment the field in its dataclass")
            assert f"| `{key}` |" in text
    for flat in SECTIONS["hetero"].flat_keys:
        assert f"| `{flat}` |" in text
    row = next(r for r in job_keys.rows(Job) if r[0] == "round_deadline_s")
    assert row[1:4] == ("`float`", "`600.0`", "(0, 2,592,000]")
    rounds = next(r for r in job_keys.rows(Job) if r[0] == "rounds")
    assert rounds[3] == "[1, 2,147,483,647]"  # the wire's int32, as job_bounds refuses it
    strategy = next(r for r in job_keys.rows(Job) if r[0] == "strategy")
    assert strategy[4] == "yes"  # must match on resume
    assert "must keep `task`, `strategy`, `strategy_params`, `mode`" in text


def test_the_strategy_reference_is_the_strategy_table() -> None:
    from fedgpu.core.job.strategies import JOB_STRATEGIES, STRATEGY_SPECS

    text = docs_hooks.expand("<!-- generated: strategies -->")
    for name in JOB_STRATEGIES:
        assert f"| `{name}` |" in text
    assert "| `fedbuff` |" not in text  # chosen by mode = "async", never named
    assert "`beta_1` (0.9" in text and STRATEGY_SPECS["median"].secagg_problem
    median = next(line for line in text.splitlines() if line.startswith("| `median` |"))
    assert median.endswith("| no | no |")


def test_a_page_asking_for_an_unknown_generated_part_fails() -> None:
    with pytest.raises(ValueError, match="unknown generated part 'nope'"):
        docs_hooks.expand("x\n<!-- generated: nope -->\n")
    assert "fedgpu job submit" in docs_hooks.expand("<!-- generated: cli -->")


def test_every_page_in_the_docs_folders_is_in_nav() -> None:
    """Pages other engineers add under docs/ must be wired into mkdocs.yml (strict also says so,
    but this names the file)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    missing = sorted(p for p in pages if not re.search(rf"\b{re.escape(p)}\b", nav))
    assert not missing, f"pages not in mkdocs.yml nav: {missing}"


def test_every_deployment_variable_is_on_the_environment_page() -> None:
    """The variables compose.yaml, `make up` and `make images` read (beyond the CLI's, whose
    table tests/unit/test_env_table.py checks) are each named on the page."""
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    read: set[str] = set()
    for rel in ("compose/compose.yaml", "compose/gpu-device-ids.yaml"):
        read |= set(re.findall(r"\$\{(FEDGPU_[A-Z_]+)", (ROOT / rel).read_text()))
    for rel in ("compose/compose.sh", "images/build.sh"):
        read |= set(re.findall(r"\b(FEDGPU_[A-Z_]+)\b", (ROOT / rel).read_text()))
    missing = sorted(v for v in read if f"`{v}`" not in page)
    assert not missing, f"docs/reference/environment.md does not name {missing}"


def test_the_docs_pins_are_the_dev_extras() -> None:
    pins = [ln.strip() for ln in (ROOT / "docs" / "requirements.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert pins and all("==" in p for p in pins), pins
    pyproject = (ROOT / "pyproject.toml").read_text()
    for pin in pins:
        assert f'"{pin}"' in pyproject, f"{pin} is not pinned the same in pyproject's dev extra"


def test_job_files_in_the_docs_validate() -> None:
    """Every TOML block of the docs that is a job file, or a part of one (a `[resources]`
    table, the ring keys), passes the aggregator's own validation."""
    import tomllib

    from fedgpu.core.job import Job, parse_job

    checked = 0
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"^```toml[^\n]*\n(.*?)^```\s*$", page.read_text(), re.S | re.M):
            raw = tomllib.loads(block)
            if not set(raw) & set(Job.__dataclass_fields__):
                continue  # another file's TOML (a pyproject.toml, connections.toml)
            if "task" not in raw and "task_dir" not in raw:
                raw = {"task": "digits", **raw}  # a part of a job file
            parse_job(raw, str(page.relative_to(ROOT)))
            checked += 1
    assert checked >= 5
