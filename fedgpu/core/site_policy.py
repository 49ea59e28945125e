"""A site's own policy: which jobs this site trains for, in a TOML file the site controls.

```toml
studies = ["onco", "cardio"]      # studies it serves (absent: any; a job naming none is refused)
tasks = ["mnist-cnn", "9f2c..."]  # task names or bundle sha256s it runs (absent: any)
task_approval = "approved"        # the node's --task-approval (node/approvals.py's allow-list)
require_secure_aggregation = true
max_epsilon = 8.0                 # require DP ([privacy] target_epsilon) of at most this
max_rounds = 50                   # per job
max_gpu_hours = 10.0              # per job: GPU time this site spends on it, counted here
hours = "20:00-06:00"             # when it trains (a window may pass midnight)
timezone = "Europe/Berlin"        # of `hours` (default UTC)
share_local_model = true          # cross-site evaluation may send this site's local model to
                                  # the aggregator and the study's other sites (default false)
```

`fedgpu node start --policy FILE` (FEDGPU_NODE_POLICY) reads it; the node checks every task
against it (`SitePolicy.refusals`) and answers a task that breaks it "ineligible" with the
reasons. The node also advertises the policy at registration: the aggregator then samples
only sites whose policy allows a job, and `fedgpu job submit` names the sites that would
refuse. That view is advisory — the aggregator cannot change the file, and the site's own
check is the one that decides (docs/explanation/security.md: site policies).

Pure and torch-free: the node, the aggregator and the CLI all run it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import re
import tomllib
import zoneinfo
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedgpu.core.constants import TASK_APPROVALS, TaskApproval
from fedgpu.core.errors import ConfigError
from fedgpu.core.suggest import did_you_mean

POLICY_ENV = "FEDGPU_NODE_POLICY"
# How a node's "ineligible" answer begins when its policy refused the task: the aggregator
# then leaves the site out of that job for REFUSAL_MEMORY_S (not only until its next
# heartbeat, as for busy GPUs), so a lasting refusal is not asked again every few seconds.
REFUSAL_PREFIX = "site policy: "
REFUSAL_MEMORY_S = 60.0
# Bounds: the policy travels in every registration and is parsed by the aggregator too.
MAX_POLICY_BYTES = 64 << 10
MAX_LIST = 1000
MAX_NAME = 128
MAX_ROUNDS = 1_000_000
MAX_GPU_HOURS = 1e6
KEYS = ("studies", "tasks", "task_approval", "require_secure_aggregation", "max_epsilon",
        "max_rounds", "max_gpu_hours", "hours", "timezone", "share_local_model")
_HOURS = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-4]):([0-5]\d)$")


@dataclass(frozen=True)
class JobTerms:
    """What a site's policy looks at in a job (core/job.Job via `terms_of`, or a task's header)."""

    job_id: str = ""
    study: str = ""
    task: str = ""
    bundle_sha256: str = ""
    rounds: int = 0
    secure_aggregation: bool = False
    dp_mode: str = ""  # "" without [privacy]
    target_epsilon: float | None = None


def terms_of(job: Any, job_id: str = "", bundle_sha256: str = "") -> JobTerms:
    """A parsed job's terms (fedgpu.core.job.Job; `study` where the job schema has it)."""
    privacy = getattr(job, "privacy", None)
    return JobTerms(
        job_id=job_id, study=str(getattr(job, "study", None) or ""), task=job.task,
        bundle_sha256=bundle_sha256, rounds=int(job.rounds),
        secure_aggregation=bool(getattr(job, "secure_aggregation", None)),
        dp_mode=str(getattr(privacy, "mode", "") or "") if privacy is not None else "",
        target_epsilon=getattr(privacy, "target_epsilon", None) if privacy is not None
        else None)


@dataclass(frozen=True)
class Hours:
    """A daily window [start, end) in minutes after midnight of `timezone`."""

    start: int
    end: int
    timezone: str

    def text(self) -> str:
        def hm(m: int) -> str:
            return f"{m // 60:02d}:{m % 60:02d}"
        return f"{hm(self.start)}-{hm(self.end)} {self.timezone}"

    def contains(self, now: dt.datetime) -> bool:
        local = now.astimezone(zoneinfo.ZoneInfo(self.timezone))
        minute = local.hour * 60 + local.minute
        if self.start <= self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end  # past midnight


@dataclass(frozen=True)
class SitePolicy:
    studies: tuple[str, ...] | None = None
    tasks: tuple[str, ...] | None = None
    task_approval: TaskApproval | None = None
    require_secure_aggregation: bool = False
    max_epsilon: float | None = None
    max_rounds: int | None = None
    max_gpu_hours: float | None = None
    hours: Hours | None = None
    # A job of mode = "cross-site" asks for the site's last local model of a training job; it
    # leaves the site only when this says so (local_model_refusal).
    share_local_model: bool = False
    source: str = field(default="", compare=False)

    # ---- the check ----------------------------------------------------------------------

    def refusals(self, job: JobTerms, now: dt.datetime | None = None,
                 gpu_hours_spent: float = 0.0, round_number: int = 0) -> list[str]:
        """Every reason this site refuses `job` ([] when it takes it). `now`: checked against
        `hours` (None: not checked — "would it ever take it", as submit asks); the site's own
        GPU-hours spent on the job and the round asked for, where the site knows them."""
        out = []
        if self.studies is not None and job.study not in self.studies:
            named = f"study {job.study!r}" if job.study else "no study"
            out.append(f"the job names {named}; this site serves {_list(self.studies)}")
        if self.tasks is not None and job.task not in self.tasks and (
                not job.bundle_sha256 or job.bundle_sha256 not in self.tasks):
            what = (f"task {job.task!r} (bundle {job.bundle_sha256[:12]})" if job.bundle_sha256
                    else f"task {job.task!r}")
            out.append(f"{what} is not among the site's tasks ({_list(self.tasks)})")
        if self.require_secure_aggregation and not job.secure_aggregation:
            out.append("the site requires secure_aggregation = true")
        if self.max_epsilon is not None:
            if not job.dp_mode or job.target_epsilon is None:
                out.append(f"the site requires differential privacy ([privacy] with "
                           f"target_epsilon <= {self.max_epsilon:g})")
            elif job.target_epsilon > self.max_epsilon:
                out.append(f"target_epsilon = {job.target_epsilon:g} is over the site's "
                           f"maximum {self.max_epsilon:g}")
        if self.max_rounds is not None:
            if job.rounds > self.max_rounds:
                out.append(f"rounds = {job.rounds} is over the site's maximum "
                           f"{self.max_rounds} per job")
            elif round_number > self.max_rounds:
                out.append(f"round {round_number} is past the site's maximum "
                           f"{self.max_rounds} per job")
        if self.max_gpu_hours is not None and gpu_hours_spent >= self.max_gpu_hours:
            out.append(f"the site has spent {gpu_hours_spent:.3g} GPU-hours on this job, "
                       f"its maximum is {self.max_gpu_hours:g}")
        if self.hours is not None and now is not None and not self.hours.contains(now):
            out.append(f"the site trains only {self.hours.text()}")
        return out

    # ---- documents ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The policy as the file would say it (keys left out where it says nothing)."""
        doc: dict[str, Any] = {}
        if self.studies is not None:
            doc["studies"] = list(self.studies)
        if self.tasks is not None:
            doc["tasks"] = list(self.tasks)
        if self.task_approval is not None:
            doc["task_approval"] = str(self.task_approval)
        if self.require_secure_aggregation:
            doc["require_secure_aggregation"] = True
        for key in ("max_epsilon", "max_rounds", "max_gpu_hours"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        if self.hours is not None:
            doc["hours"] = self.hours.text().split(" ")[0]
            doc["timezone"] = self.hours.timezone
        if self.share_local_model:
            doc["share_local_model"] = True
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def summary(self) -> str:
        """One line for logs: what the policy asks."""
        parts = [f"{k}={v}" for k, v in self.to_dict().items()]
        return ", ".join(parts) or "no conditions"


def refuses_study(policy: SitePolicy | None, study: str) -> str | None:
    """Why a site with `policy` would not join or serve `study` (None: it would): the check
    behind enrolling a site in a study, on the policy the site advertised."""
    if policy is None or policy.studies is None or study in policy.studies:
        return None
    return f"{REFUSAL_PREFIX}this site serves {_list(policy.studies)}, not study {study!r}"


def local_model_refusal(policy: SitePolicy | None) -> str | None:
    """Why this site does not send its local model of a training job to a cross-site job
    (None: it does). A local model was fitted to one site's data alone and says more about it
    than an average does (membership, a rare case it memorised), and the cross-site job sends
    it on to every other site of the study: so it leaves a site only on the site's word,
    `share_local_model = true`; no policy, or a policy without the key, keeps it home."""
    if policy is None:
        return (f"{REFUSAL_PREFIX}none set, and a site shares its local model only when its "
                "policy says share_local_model = true")
    if not policy.share_local_model:
        return f"{REFUSAL_PREFIX}share_local_model = false"
    return None


def stricter_approval(flag: TaskApproval, policy: TaskApproval | None) -> TaskApproval:
    """The node's task approval: its --task-approval, narrowed by the policy's (the file can
    only make the site stricter: installed < approved < any)."""
    if policy is None:
        return flag
    order = list(TaskApproval)
    return min(flag, policy, key=order.index)


def _list(items: tuple[str, ...]) -> str:
    shown = ", ".join(repr(i) for i in items[:8])
    return (shown + (", ..." if len(items) > 8 else "")) or "none"


def _strings(key: str, value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: {key} must be a list of names, e.g. {key} = [\"onco\"]")
    if len(value) > MAX_LIST or any(len(v) > MAX_NAME for v in value):
        raise ConfigError(f"{where}: {key}: at most {MAX_LIST} names of at most {MAX_NAME} "
                          "characters")
    return tuple(dict.fromkeys(value))


def _number(key: str, value: Any, where: str, integer: bool, top: float) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool) or not math.isfinite(value) or not 0 < value <= top:
        kind = "a whole number" if integer else "a number"
        raise ConfigError(f"{where}: {key} must be {kind} above 0 (at most {top:g}), "
                          f"not {value!r}")
    return int(value) if integer else float(value)


def _hours(value: Any, tz: Any, where: str) -> Hours:
    match = _HOURS.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{where}: hours must be a daily window \"HH:MM-HH:MM\" (e.g. "
                          f"\"20:00-06:00\"), not {value!r}")
    start = int(match[1]) * 60 + int(match[2])
    end = int(match[3]) * 60 + int(match[4])
    if end > 24 * 60 or start == end:
        raise ConfigError(f"{where}: hours {value!r} is an empty window")
    if not isinstance(tz, str):
        raise ConfigError(f"{where}: timezone must be a name such as \"Europe/Berlin\"")
    try:
        zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"{where}: unknown timezone {tz!r} (an IANA name such as "
                          "\"Europe/Berlin\" or \"UTC\")") from None
    return Hours(start, end, tz)


def from_dict(raw: dict[str, Any], where: str = "site policy") -> SitePolicy:
    """A policy from its TOML (or advertised JSON) document, checked strictly."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a policy is a table of keys")
    for key in raw:
        if key not in KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(key, KEYS)}; "
                              f"a site policy knows {', '.join(KEYS)}")
    approval = raw.get("task_approval")
    if approval is not None and approval not in TASK_APPROVALS:
        raise ConfigError(f"{where}: task_approval must be one of {', '.join(TASK_APPROVALS)}, "
                          f"not {approval!r}{did_you_mean(str(approval), TASK_APPROVALS)}")
    secagg = raw.get("require_secure_aggregation", False)
    if not isinstance(secagg, bool):
        raise ConfigError(f"{where}: require_secure_aggregation must be true or false")
    share = raw.get("share_local_model", False)
    if not isinstance(share, bool):
        raise ConfigError(f"{where}: share_local_model must be true or false")
    if "timezone" in raw and "hours" not in raw:
        raise ConfigError(f"{where}: timezone is the zone of `hours`, which is not given")
    return SitePolicy(
        studies=_strings("studies", raw["studies"], where) if "studies" in raw else None,
        tasks=_strings("tasks", raw["tasks"], where) if "tasks" in raw else None,
        task_approval=TaskApproval(approval) if approval is not None else None,
        require_secure_aggregation=secagg,
        max_epsilon=(_number("max_epsilon", raw["max_epsilon"], where, False, 1e6)
                     if "max_epsilon" in raw else None),
        max_rounds=(_number("max_rounds", raw["max_rounds"], where, True, MAX_ROUNDS)
                    if "max_rounds" in raw else None),
        max_gpu_hours=(_number("max_gpu_hours", raw["max_gpu_hours"], where, False,
                               MAX_GPU_HOURS) if "max_gpu_hours" in raw else None),
        hours=(_hours(raw["hours"], raw.get("timezone", "UTC"), where)
               if "hours" in raw else None),
        share_local_model=share,
        source=where)


def parse(text: str, where: str = "site policy") -> SitePolicy:
    if len(text.encode()) > MAX_POLICY_BYTES:
        raise ConfigError(f"{where}: over {MAX_POLICY_BYTES} bytes")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    return from_dict(raw, where)


def load(path: Path) -> SitePolicy:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the site policy {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"site policy {path}: not UTF-8 text") from None
    return parse(text, str(path))


def from_json(text: str, where: str) -> SitePolicy | None:
    """An advertised policy ('' or '{}'-less: None, the site said none)."""
    if not text:
        return None
    if len(text) > MAX_POLICY_BYTES:
        raise ConfigError(f"{where}: the advertised policy is over {MAX_POLICY_BYTES} bytes")
    try:
        raw = json.loads(text)
    except ValueError:
        raise ConfigError(f"{where}: the advertised policy is not JSON") from None
    return from_dict(raw, where)
