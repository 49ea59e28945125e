"""The aggregator's task bundles: checked archives kept in the state directory by hash.

`<state dir>/bundles/<sha256>.tar`, written once (to a temporary name, fsynced, renamed), shared
by every job submitted with the same sources; the job database references it by sha256. The
aggregator never unpacks or imports a bundle: it checks the archive (fedgpu.core.bundles) when
it arrives and serves the bytes to nodes, which check it again.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedgpu.core.bundles import Bundle, BundleError, check_sha256, digest
from fedgpu.proto import pb
from fedgpu.server.jobs.state import JobRow

BUNDLES_DIR = "bundles"
# Bundles offered to nodes at once (those of the oldest jobs not yet ended): what a heartbeat
# reply carries stays small however long the queue.
MAX_OFFERS = 16


def offers_of(pending: list[JobRow]) -> list[pb.TaskBundle]:
    """The bundles of these jobs (not yet ended, oldest first), each once."""
    seen: dict[str, pb.TaskBundle] = {}
    for row in pending:
        ref = row.bundle
        if ref is not None and ref.sha256 not in seen:
            seen[ref.sha256] = pb.TaskBundle(sha256=ref.sha256, size=ref.size, name=ref.name,
                                             entry=ref.entry, job_id=row.job_id)
        if len(seen) >= MAX_OFFERS:
            break
    return list(seen.values())


class BundleStore:
    def __init__(self, state_dir: Path) -> None:
        self.directory = Path(state_dir) / BUNDLES_DIR

    def path(self, sha256: str) -> Path:
        return self.directory / f"{check_sha256(sha256)}.tar"

    def put(self, bundle: Bundle) -> Path:
        """Keep a checked bundle (a no-op when the same bytes are kept already)."""
        target = self.path(bundle.sha256)
        if target.exists() and digest(target.read_bytes()) == bundle.sha256:
            return target
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
        with open(tmp, "wb") as fh:
            fh.write(bundle.data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        return target

    def read(self, sha256: str) -> bytes:
        """The archive's bytes, checked against its name (a damaged copy is never served)."""
        path = self.path(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BundleError(f"bundle {sha256} is not in {self.directory}") from None
        if digest(data) != sha256:
            raise BundleError(f"{path} no longer matches its hash (changed on disk); submit "
                              "the job again with its task directory")
        return data
