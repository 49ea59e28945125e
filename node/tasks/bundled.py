"""A task that came as a bundle, loaded inside the round's worker process (never the agent's).

The agent hands the worker the path of the site's cached archive and the sha256 it approved.
Here, in order: the archive's bytes are hashed again (a copy changed on disk since it was
checked is refused), opened with every check of fedgpu.core.bundles, the manifest must be the
one the agent was told of, its `requires` must be met by this environment (metadata only,
nothing installed), and its top-level module must not shadow an installed one. Only then are
its files written into the round's own work directory and its entry imported from there: the
code that runs is exactly the code whose hash the site approved.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedgpu.core.bundle_requires import unmet_requirements
from fedgpu.core.bundles import BundleError, check_sha256, open_archive, unpack
from fedgpu.node.tasks import DatasetTask, Task, TaskLoadError

# Under the round's work directory, removed with it.
UNPACK_DIR = "bundle"


@dataclass(frozen=True)
class BundleSpec:
    """task.json's `bundle` section."""

    path: Path
    sha256: str
    name: str
    entry: str

    @classmethod
    def parse(cls, raw: object) -> BundleSpec:
        if not isinstance(raw, dict) or not all(
                isinstance(raw.get(k), str) for k in ("path", "sha256", "name", "entry")):
            raise BundleError("task.json: 'bundle' must hold path, sha256, name and entry "
                              "(strings)")
        return cls(Path(raw["path"]), check_sha256(raw["sha256"]), raw["name"], raw["entry"])


def load_bundle_task(spec: BundleSpec, workdir: Path) -> Task | DatasetTask:
    try:
        data = spec.path.read_bytes()
    except OSError as exc:
        raise BundleError(f"cannot read the cached bundle {spec.path}: {exc.strerror or exc}"
                          ) from None
    try:
        bundle = open_archive(data, spec.sha256)
    except BundleError as exc:
        raise BundleError(f"the cached copy {spec.path} of bundle {spec.sha256} is refused: "
                          f"{exc}") from None
    manifest = bundle.manifest
    if (manifest.name, manifest.entry) != (spec.name, spec.entry):
        raise BundleError(f"bundle {spec.sha256[:12]}: its manifest names {manifest.name!r} "
                          f"({manifest.entry}), the task names {spec.name!r} ({spec.entry})")
    unmet = unmet_requirements(manifest.requires)
    if unmet:
        raise BundleError(f"task {manifest.name!r} requires what this node lacks: "
                          f"{'; '.join(unmet)} (nothing is installed at run time)")
    top = manifest.top_level
    if top in sys.modules or importlib.util.find_spec(top) is not None:
        raise BundleError(f"bundle {spec.sha256[:12]}: its top-level module {top!r} would "
                          "shadow a module installed on this node; rename its package")
    root = unpack(bundle, Path(workdir) / UNPACK_DIR)
    # The archive is the record of what ran; no bytecode is left beside the sources.
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(manifest.module)
        obj: Any = getattr(module, manifest.attribute)
        task = obj() if isinstance(obj, type) else obj
    except Exception as exc:
        raise TaskLoadError(f"task {manifest.name!r} (bundle {spec.sha256[:12]}, "
                            f"{manifest.entry}) failed to load: {type(exc).__name__}: {exc}"
                            ) from exc
    if not isinstance(task, DatasetTask | Task):
        raise TaskLoadError(
            f"task {manifest.name!r} ({manifest.entry}) does not implement a task contract "
            "(tensors: name, build_model, load_data, train, evaluate; or Datasets: name, "
            "build_model, load_datasets, optimizer, batch_loss; see node/tasks/base.py)")
    return task
