"""The agent's side of task bundles: the site's consent, the cache, and what the aggregator is
told.

- The aggregator offers the bundles of its jobs not yet ended (RegisterReply, HeartbeatReply).
  The keeper fetches each one it has not cached (in the background: heartbeats go on), checks
  it (fedgpu.core.bundles: hash, archive safety, manifest, entry) and keeps it in the site's
  state directory, where `fedgpu node tasks` lists it as pending until the site decides.
- Every heartbeat answers about each offered bundle: approved, pending, rejected, or unusable
  (a requirement this node lacks, a bundle that failed its checks). The aggregator samples only
  nodes that may run a job's bundle, so a job waits for approvals instead of failing rounds.
- A task naming a bundle runs only if the site's mode allows it (`--task-approval`), from the
  cached archive whose hash was checked just now; otherwise the task is answered as failed,
  with a message naming the hash and the command that approves it.

The agent never imports a bundle: only the round's worker process does (node/tasks/bundled.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedgpu.core.bundle_requires import unmet_requirements
from fedgpu.core.bundles import Bundle, BundleError, check_sha256, open_archive
from fedgpu.core.constants import BundleState, TaskApproval
from fedgpu.node.approvals import SiteTasks
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node.bundles")

# After a fetch that failed for a reason another try may not have (the aggregator restarting),
# the next try waits this long.
RETRY_FETCH_S = 15.0


class BundleKeeper:
    def __init__(self, mode: TaskApproval, state_dir: Path,
                 fetch: Callable[[str], bytes]) -> None:
        """`fetch(sha256)`: the bundle's bytes from the aggregator, digest checked."""
        self.mode = TaskApproval(mode)
        self.site = SiteTasks(state_dir)
        self._fetch = fetch
        self._lock = threading.Lock()
        self._unusable: dict[str, str] = {}
        self._fetching: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._announced: set[str] = set()

    def start_line(self) -> str:
        """What the agent logs at start about code from the wire."""
        if self.mode == TaskApproval.ANY:
            return ("--task-approval any: this node runs EVERY task bundle the aggregator "
                    "sends, without the site's approval; for local demos only")
        if self.mode == TaskApproval.APPROVED:
            return (f"--task-approval approved: task bundles run once approved at this site "
                    f"(state directory {self.site.root}; 'fedgpu node tasks' lists them)")
        return "--task-approval installed: only tasks installed on this node run"

    # ---- answers for the aggregator -------------------------------------------------

    def answer(self, offers: Sequence[pb.TaskBundle]) -> list[pb.BundleStatus]:
        """The site's state of each offered bundle; fetches those not cached yet."""
        if self.mode == TaskApproval.INSTALLED:
            return []
        out = []
        for offer in offers:
            try:
                sha = check_sha256(offer.sha256)
            except BundleError:
                continue
            state = self._state(sha)
            if state != BundleState.REJECTED and not self.site.archive_path(sha).exists():
                self._fetch_later(offer)
            with self._lock:
                unusable = self._unusable.get(sha)
            if unusable is not None:
                # One printable line within the aggregator's bounds
                # (server/transfer/wire_limits.py): a heartbeat it refused would make this node
                # look gone.
                reason = "".join(c if c.isprintable() else " " for c in unusable)
                out.append(pb.BundleStatus(sha256=sha, state=BundleState.UNUSABLE,
                                           reason=" ".join(reason.split())[:1000]))
            else:
                out.append(pb.BundleStatus(sha256=sha, state=state))
        return out

    def _state(self, sha: str) -> BundleState:
        if self.mode == TaskApproval.ANY:
            return BundleState.APPROVED
        return self.site.state(sha) or BundleState.PENDING

    def _fetch_later(self, offer: pb.TaskBundle) -> None:
        with self._lock:
            if (offer.sha256 in self._fetching or offer.sha256 in self._unusable
                    or time.monotonic() < self._retry_at.get(offer.sha256, 0.0)):
                return
            self._fetching.add(offer.sha256)
        copy = pb.TaskBundle()
        copy.CopyFrom(offer)
        threading.Thread(target=self._fetch_quietly, args=(copy,), daemon=True,
                         name=f"bundle-{offer.sha256[:8]}").start()

    def _fetch_quietly(self, offer: pb.TaskBundle) -> None:
        try:
            self.obtain(offer)
        except BundleError as exc:
            log.error("task bundle %s: %s", offer.sha256, exc)
        except Exception as exc:  # the aggregator away, a broken stream: try again later
            log.warning("cannot fetch task bundle %s yet: %s", offer.sha256[:12], exc)
            with self._lock:
                self._retry_at[offer.sha256] = time.monotonic() + RETRY_FETCH_S
        finally:
            with self._lock:
                self._fetching.discard(offer.sha256)

    def obtain(self, offer: pb.TaskBundle) -> Bundle:
        """The bundle, checked: from the cache (its hash checked now) or fetched and kept.
        BundleError (remembered as unusable) when it fails a check or a requirement."""
        sha = offer.sha256
        data = self.site.cached(sha)  # BundleError when the cached copy changed on disk
        fresh = data is None
        if data is None:
            data = self._fetch(sha)
        try:
            bundle = open_archive(data, sha)
            if fresh:
                # Kept even when this node cannot run it: the site sees what it was sent.
                self.site.keep(bundle, offer.job_id)
                self._announce(bundle, offer.job_id)
            unmet = unmet_requirements(bundle.manifest.requires)
            if unmet:
                raise BundleError(f"task {bundle.manifest.name!r} requires what this node "
                                  f"lacks: {'; '.join(unmet)} (nothing is installed at run "
                                  "time: the site installs it in its node image)")
        except BundleError as exc:
            with self._lock:
                self._unusable[sha] = str(exc)
            raise
        return bundle

    def _announce(self, bundle: Bundle, job_id: str) -> None:
        if bundle.sha256 in self._announced:
            return
        self._announced.add(bundle.sha256)
        state = self._state(bundle.sha256)
        if self.mode == TaskApproval.APPROVED and state == BundleState.PENDING:
            log.warning("task bundle %s (task %r, job %s) waits for this site's approval: "
                        "review %s, then 'fedgpu node approve %s --state-dir %s'",
                        bundle.sha256, bundle.manifest.name, job_id or "?",
                        self.site.archive_path(bundle.sha256), bundle.sha256, self.site.root)
        else:
            log.info("task bundle %s (task %r) cached: %s", bundle.sha256,
                     bundle.manifest.name, state)

    # ---- a task that names a bundle --------------------------------------------------

    def prepare(self, offer: pb.TaskBundle) -> tuple[dict[str, Any] | None, str]:
        """The task.json section that points the worker at the checked archive, or why this
        node refuses the task (a one-line message for the aggregator)."""
        sha = offer.sha256
        if self.mode == TaskApproval.INSTALLED:
            return None, (f"this node runs installed tasks only (--task-approval installed): "
                          f"task {offer.name!r} came as bundle {sha}; the site can bake it "
                          "into its node image, or allow bundles with --task-approval approved")
        try:
            check_sha256(sha)
        except BundleError as exc:
            return None, str(exc)
        state = self._state(sha)
        if state == BundleState.REJECTED:
            return None, (f"bundle {sha} (task {offer.name!r}) was rejected at this site; "
                          f"'fedgpu node approve {sha}' there allows it")
        if state != BundleState.APPROVED:
            if not self.site.archive_path(sha).exists():
                self._fetch_later(offer)
            return None, (f"bundle {sha} (task {offer.name!r}) is not approved at this site "
                          f"(--task-approval approved): review it, then run 'fedgpu node "
                          f"approve {sha}' there")
        try:
            bundle = self.obtain(offer)
        except BundleError as exc:
            return None, f"bundle {sha}: {exc}"
        except Exception as exc:
            return None, f"cannot fetch bundle {sha[:12]} from the aggregator: {exc}"
        if (bundle.manifest.name, bundle.manifest.entry) != (offer.name, offer.entry):
            return None, (f"bundle {sha[:12]}: the aggregator names it {offer.name!r} "
                          f"({offer.entry}) but its manifest says {bundle.manifest.name!r} "
                          f"({bundle.manifest.entry})")
        if self.mode == TaskApproval.ANY:
            log.warning("running task bundle %s (task %r) without the site's approval "
                        "(--task-approval any)", sha, bundle.manifest.name)
        return {"bundle": {"path": str(self.site.archive_path(sha)), "sha256": sha,
                           "name": bundle.manifest.name, "entry": bundle.manifest.entry}}, ""
