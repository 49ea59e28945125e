"""The job schema's parts: what one job-file key declares (`Key`), how a section of keys
registers (`Section`), and the generic checks every key goes through.

A key is declared once, on the dataclass field that holds it (`key(...)` in the field's
metadata): its type, its range, its default, a line of doc, whether a resumed job must keep it
(`resume`) and whether it travels to the nodes (`travels`). The parse loop (job.py), the
bounds check, the resume check (server/jobs/resume.py) and the job-file reference page
(tools/job_keys.py) all read these declarations; nothing keeps a second copy of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fedgpu.core.errors import ConfigError
from fedgpu.core.suggest import did_you_mean

# Kinds a key's value may have in a job file.
TABLE = "table"  # a table of scalars ([hyperparameters], [strategy_params])
ANY = "any"      # checked by the key's own rule (mixing: a name or a matrix)


@dataclass(frozen=True)
class Key:
    """One job-file key."""

    doc: str
    # int, float, str, bool, TABLE or ANY (bool is never taken for an int).
    kind: Any
    # What a refusal says the value must be ("a positive integer").
    expected: str
    name: str = ""
    default: Any = None
    # The range its meaning allows: below lo (or at it, lo_open) or above hi is refused with
    # `expected`.
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    # None is a value (the key may be absent: "none").
    optional: bool = False
    # What the wire, SQLite or memory can hold: refused naming this range before anything
    # else is read of the file (job_bounds.py).
    bound: tuple[float, float] | None = None
    # A resumed job must keep this key's value (its checkpoint would train another model).
    resume: bool = False
    # Sent to the nodes with every task (in the task header or its hyperparameters).
    travels: bool = False
    # Extra predicate on a value of the right kind (a task name's characters).
    valid: Callable[[Any], bool] | None = None
    # The dataclass has no default (the reference page says "required").
    required: bool = False

    def fail(self, source: str, value: object, prefix: str = "") -> ConfigError:
        return ConfigError(f"{source}: '{prefix}{self.name}' must be {self.expected}, got "
                           f"{value!r}")

    def read(self, raw: Mapping[str, Any], source: str, prefix: str = "") -> Any:
        """The key's value from `raw` (the default when absent), checked."""
        if self.name not in raw:
            return self.default
        value = raw[self.name]
        if value is None and self.optional:
            return None
        if self.kind is TABLE or self.kind is ANY:
            return value  # its section or rule checks it
        if isinstance(value, bool) and self.kind is not bool:
            raise self.fail(source, value, prefix)
        kinds = (int, float) if self.kind is float else (self.kind,)
        if not isinstance(value, kinds):
            raise self.fail(source, value, prefix)
        if self.choices and value not in self.choices:
            hint = did_you_mean(value, self.choices) if isinstance(value, str) else ""
            raise ConfigError(f"{source}: '{prefix}{self.name}' must be {self.expected}, got "
                              f"{value!r}{hint}")
        if self.kind is float:
            value = float(value)
            if not math.isfinite(value):
                raise self.fail(source, value, prefix)
        if self.valid is not None and not self.valid(value):
            raise self.fail(source, value, prefix)
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            raise self.fail(source, value, prefix)
        if self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)):
            raise self.fail(source, value, prefix)
        return value

    def range_text(self) -> str:
        """The range for the reference page ('' when any value of the kind will do)."""
        if self.choices:
            return ", ".join(f"`{c}`" for c in self.choices)
        if self.bound is not None and self.lo is None and self.hi is None:
            return f"{_num(self.bound[0])} to {_num(self.bound[1])}"
        if self.lo is None and self.hi is None:
            return ""
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        hi = self.hi if self.hi is not None else (self.bound[1] if self.bound else None)
        lo = "-inf" if self.lo is None else _num(self.lo)
        return f"{left}{lo}, {_num(hi)}{right}" if hi is not None else f"{left}{lo}, inf)"


def _num(value: float) -> str:
    """A bound as people read it: 2,147,483,647 rather than 2.14748e+09."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:g}"


REQUIRED: Any = dataclasses.MISSING


def key(default: Any, doc: str, kind: Any, expected: str, **declared: Any) -> Any:
    """A dataclass field that is a job-file key (see Key for what it declares); `REQUIRED`:
    no default (a dataclass built in code must give it; a file may leave it to a rule)."""
    if default is REQUIRED:
        return dataclasses.field(metadata={"key": Key(doc=doc, kind=kind, expected=expected,
                                                      default="", required=True, **declared)})
    spec = Key(doc=doc, kind=kind, expected=expected, default=default, **declared)
    if isinstance(default, dict | list):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 metadata={"key": spec})
    return dataclasses.field(default=default, metadata={"key": spec})


def keys_of(cls: type) -> list[Key]:
    """The keys a dataclass declares, in order, each with its name."""
    return [dataclasses.replace(f.metadata["key"], name=f.name)
            for f in dataclasses.fields(cls) if "key" in f.metadata]


@dataclass(frozen=True)
class Section:
    """A group of keys with its own parser: a table (`[privacy]`) or keys at the top level
    (`flat`: the heterogeneous-work keys). `parse(raw, parsed, source)` gets the whole file and
    the top-level values already checked, and returns the section's value for `Job`."""

    name: str
    doc: str
    parse: Callable[[Mapping[str, Any], dict[str, Any], str], Any]
    # The dataclass its keys live on (the reference page lists its fields).
    cls: type
    # Keys at the top level of the file instead of a table of their own.
    flat_keys: frozenset[str] = frozenset()
    resume: bool = False
    travels: bool = False

    @property
    def flat(self) -> bool:
        return bool(self.flat_keys)


Rule = Callable[[dict[str, Any], str], None]

SECTIONS: dict[str, Section] = {}
# Checks across top-level keys (run before the sections: a section may rely on them), and
# across sections (features that do not combine), run after every section. A rule may
# replace a value in the dict it gets (the checked form of a key).
KEY_RULES: list[Rule] = []
COMBINATION_RULES: list[Rule] = []


def register(section: Section) -> Section:
    SECTIONS[section.name] = section
    return section


def key_rule(check: Rule) -> Rule:
    KEY_RULES.append(check)
    return check


def combination_rule(check: Rule) -> Rule:
    COMBINATION_RULES.append(check)
    return check


def refuse_unknown(given: Iterable[str], known: Iterable[str], source: str,
                   where: str = "") -> None:
    """ConfigError naming the unknown keys, the nearest known one and every allowed key."""
    known = sorted(known)
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    hint = "".join(did_you_mean(k, known) for k in unknown[:3])
    place = f" in [{where}]:" if where else ""
    raise ConfigError(f"{source}: unknown key(s){place} {', '.join(unknown)}{hint}; allowed: "
                      f"{', '.join(known)}")
