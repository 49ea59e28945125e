"""The agent's status file: what `fedgpu node health` (the container HEALTHCHECK) and
`fedgpu ps` read to know the agent is alive, talking to its aggregator, and what it decided.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("fedgpu.node")


def write_status(path: Path, doc: dict[str, Any]) -> None:
    """Replace the file atomically; a failed write is logged, never fatal to the agent."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("cannot write status file: %s", exc)


def status_is_fresh(path: Path, now: float | None = None) -> tuple[bool, str]:
    """For the container HEALTHCHECK: is the agent alive and talking to its aggregator?"""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return False, f"no status file at {path}: the agent has not started"
    except (OSError, json.JSONDecodeError) as exc:
        return False, f"unreadable status file {path}: {exc}"
    age = (now or time.time()) - float(doc.get("time", 0))
    limit = 3 * float(doc.get("heartbeat_interval_s", 5)) + 30
    if age > limit:
        return False, f"status is {age:.0f}s old (limit {limit:.0f}s); state {doc.get('state')}"
    return True, f"state {doc.get('state')}, updated {age:.0f}s ago"
