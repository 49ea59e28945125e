"""Who this node is, kept in its state directory: a name and a secret that stay the same from
one start to the next, so the aggregator can tell a node coming back from a second agent that
happens to use the same name.

Two agents on one host used to take the hostname both, evict each other at every
registration, and thrash. Now:

- an agent started without a name takes the first free default identity of the state
  directory: `HOSTNAME-xxxxxx`, the suffix random once and then kept, so two agents of one host
  get two names and each gets the same name back at its next start (a default identity is
  claimed with an flock held while the agent runs, so a crashed agent leaves no stale claim);
- an agent started with `--name NAME` keeps the secret of that name in
  `<state dir>/identity/named/NAME/` (not locked: a restarted agent may overlap the old one
  for a moment, and the aggregator lets the same identity take its name over);
- the secret travels in RegisterRequest.identity; the aggregator refuses a live name to anyone
  presenting another one (server/registry.py).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fedgpu.core.errors import FedgpuError

# Default identities one state directory hands out: more agents than this on one host and one
# state directory are a mistake, not a fleet (`fedgpu node start-many` names its own nodes).
MAX_DEFAULT_IDENTITIES = 64
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
log = logging.getLogger("fedgpu.node")


@dataclass
class NodeIdentity:
    name: str
    secret: str
    folder: Path
    # The open lock file: the claim lasts as long as this process keeps it open.
    _lock: IO[str] | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _lock(folder: Path) -> IO[str] | None:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fh = open(folder / "lock", "a+")  # noqa: SIM115 - held open for the claim's lifetime
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    return fh


def _load(folder: Path, default_name: str | None) -> tuple[str, str]:
    """(name, secret) of an identity folder, made on first use (the secret 0600)."""
    path = folder / "identity.json"
    try:
        doc = json.loads(path.read_text())
        name, secret = str(doc["name"]), str(doc["secret"])
        if name and len(secret) == 64:
            return name, secret
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or damaged: a new identity (the aggregator sees a new node)
    name = default_name or f"{socket.gethostname()}-{secrets.token_hex(3)}"
    secret = secrets.token_hex(32)
    tmp = folder / "identity.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"name": name, "secret": secret}, fh)
    tmp.replace(path)
    return name, secret


def claim(state_dir: Path, name: str | None) -> NodeIdentity:
    """This agent's identity: under `name`, or the first free default one."""
    root = Path(state_dir) / "identity"
    if name is not None:
        folder = root / "named" / _SAFE.sub("_", name)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        _, secret = _load(folder, name)
        return NodeIdentity(name, secret, folder)
    for i in range(MAX_DEFAULT_IDENTITIES):
        folder = root / f"default-{i}"
        held = _lock(folder)
        if held is not None:
            found, secret = _load(folder, None)
            return NodeIdentity(found, secret, folder, held)
    raise FedgpuError(f"{MAX_DEFAULT_IDENTITIES} node agents already run with the state "
                      f"directory {state_dir}: give this one a --name and its own --state-dir")


def claim_or_anonymous(state_dir: Path, name: str | None) -> NodeIdentity:
    """claim(), or no identity when the state directory cannot be written (a read-only home):
    the node still runs, under its name or the hostname, as nodes before identities did."""
    try:
        return claim(state_dir, name)
    except OSError as exc:
        log.warning("no node identity (cannot write %s: %s): a second agent under this "
                    "node's name would replace it at the aggregator", state_dir, exc)
        return NodeIdentity(name or socket.gethostname(), "", Path(state_dir))
