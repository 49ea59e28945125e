"""The job file's reference for the docs site, generated from the job schema
(fedgpu/core/job/): every key with its type, default, range, resume rule, whether it travels
to the nodes and its line of doc; the resume rules; the strategy table.

Keys declared with `schema.key(...)` (the `Job` and `Resources` dataclasses) carry all of that
themselves. A registered section whose dataclass lives with its feature (`[privacy]`,
`[secure_aggregation]`, the unlike-sites keys) is listed from its dataclass: type and default
from the field, the doc from the comment above the field. tools/docs_hooks.py puts the result
into docs/reference/job-file.md at build time; tests/docs/test_reference.py fails when a key
has no doc, so a new key cannot be left undocumented.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import sys
import textwrap
import typing
from typing import Any

Row = tuple[str, str, str, str, str, str, str]  # key, type, default, range, resume, travels, doc


def _comments(cls: type) -> dict[str, str]:
    """The comment lines right above each field of `cls`, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    (node,) = ast.parse(source).body
    found: dict[str, str] = {}
    for stmt in node.body:  # type: ignore[attr-defined]
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        i = stmt.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        if above:
            found[stmt.target.id] = " ".join(above)
    return found


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(f'`"{m.value}"`' for m in tp)
    text = getattr(tp, "__name__", None) if isinstance(tp, type) else None
    text = text or str(tp).replace("typing.", "")
    return f"`{text.replace('NoneType', 'None').replace('|', '/')}`"


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if value == {}:
        return "empty"
    return f"`{value}`"


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return _shown(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "see below" if dataclasses.is_dataclass(value) else _shown(value)
    return "required"


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def rows(cls: type, travels: bool = False) -> list[Row]:
    """One row per key of `cls` (a dataclass of the schema), flat sections expanded;
    `travels`: the section as a whole goes to the nodes."""
    from fedgpu.core.job.schema import SECTIONS

    hints = typing.get_type_hints(cls)
    comments = _comments(cls)
    out: list[Row] = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("key")
        section = SECTIONS.get(f.metadata.get("section", ""))
        if section is not None and section.flat:
            out += rows(section.cls, section.travels)
        elif f.metadata.get("flat"):  # a dataclass whose keys sit in its parent's table
            out += rows(hints[f.name], travels)
        elif section is not None:
            out.append((f.name, "table", "see below" if _default(f) == "see below" else "none",
                        "", _yes(section.resume), _yes(section.travels),
                        f"{section.doc} The table `[{f.name}]`, below."))
        elif spec is not None:
            out.append((f.name, _type_name(hints[f.name]), _default(f), spec.range_text(),
                        _yes(spec.resume), _yes(spec.travels), spec.doc))
        else:
            out.append((f.name, _type_name(hints[f.name]), _default(f), "", "",
                        _yes(travels), comments.get(f.name, "")))
    return out


def tables() -> list[tuple[str, type, bool]]:
    """(TOML table, dataclass, travels to the nodes) for the job and every registered table
    in it, the job first."""
    from fedgpu.core.job import Job
    from fedgpu.core.job.schema import SECTIONS

    return [("", Job, False)] + [(s.name, s.cls, s.travels) for s in SECTIONS.values()
                                 if not s.flat]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown(heading: str = "###") -> str:
    from fedgpu.core.job import resume_keys

    out: list[str] = []
    for table, cls, whole in tables():
        title = "Top-level keys" if not table else f"`[{table}]`"
        out += [f"{heading} {title}", ""]
        out += ["| key | type | default | range | resume | to nodes | what it does |",
                "|---|---|---|---|---|---|---|"]
        for key, tp, default, span, resume, travels, text in rows(cls, whole):
            out.append(f"| `{key}` | {tp} | {default} | {_cell(span)} | {resume} | {travels} "
                       f"| {_cell(text)} |")
        out.append("")
    must = ", ".join(f"`{k}`" for k in resume_keys())
    out += [f"{heading} Resuming", "",
            f"A job resumed from its checkpoint (an aggregator restarted on its state "
            f"directory) must keep {must} (the column *resume*): another value would train "
            "another model from this one's weights, so the job is refused naming the key. Every "
            "other key may change between restarts; the aggregator logs which did.", ""]
    return "\n".join(out)


def strategies() -> str:
    """The strategy table (fedgpu/core/job/strategies.py) as the reference lists it."""
    from fedgpu.core.job.strategies import JOB_STRATEGIES, STRATEGY_SPECS

    out = ["| `strategy` | what it does | `[strategy_params]` (defaults) | with secure "
           "aggregation | with `[privacy]` |", "|---|---|---|---|---|"]
    for name in JOB_STRATEGIES:
        spec = STRATEGY_SPECS[name]
        params = ", ".join(
            f"`{p.name}` ({p.default if p.default != '' else 'none'}; {p.expected()})"
            for p in spec.params) or "-"
        out.append(f"| `{name}` | {_cell(spec.doc)} | {_cell(params)} | "
                   f"{'no' if spec.secagg_problem else 'yes'} | {'yes' if spec.dp_ok else 'no'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n" + strategies())
