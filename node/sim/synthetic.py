"""What a simulated node sends instead of a trained model: a synthetic model of the asked shape,
and per round a node-specific step along a direction the whole process shares."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import numpy as np

from fedgpu.core import codec, local_params
from fedgpu.node.sim.personal import LocalLayers
from fedgpu.proto import pb


@functools.lru_cache(maxsize=4)
def file_payload(path: Path) -> tuple[int, str, bytes]:
    """(size, digest, segment digests) of an update file (codec.WIRE_DIGEST), hashed once per
    process in one pass."""
    return path.stat().st_size, *codec.file_digests(path, codec.WIRE_DIGEST)


def model_shapes(params: int, tensors: int) -> dict[str, tuple[int, ...]]:
    """`tensors` float32 tensors totalling `params` elements (the last one takes the rest)."""
    if params < tensors or tensors < 1:
        raise ValueError("need at least one parameter per tensor")
    each = params // tensors
    sizes = [each] * (tensors - 1) + [params - each * (tensors - 1)]
    shapes: dict[str, tuple[int, ...]] = {}
    for i, n in enumerate(sizes):
        # Two-dimensional where it divides, like the weight matrices of a real model.
        cols = 256 if n % 256 == 0 else 1
        shapes[f"layer{i:03d}.weight"] = (n // cols, cols) if cols > 1 else (n,)
    return shapes


def synthetic_model(params: int, tensors: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape, dtype=np.float32) * 0.05)
            for name, shape in model_shapes(params, tensors).items()}


class Noise:
    """One random direction per tensor shared by all nodes of the process; each node scales
    it by its own factor, so updates differ without generating K random models per round."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = (name, shape)
        if key not in self._arrays:
            # crc32, not hash(): str hashes change per process and the noise must not.
            rng = np.random.default_rng(zlib.crc32(f"{name}{shape}".encode()))
            self._arrays[key] = rng.standard_normal(shape, dtype=np.float32) * 0.01
        return self._arrays[key]


def step_scale(index: int, round_: int) -> np.float32:
    """A node-specific step that shrinks with the round."""
    return np.float32((1 + index % 7) / (1 + round_))


def trained(noise: Noise, index: int, header: pb.TaskHeader, payload: memoryview,
            layers: LocalLayers | None = None, patterns: tuple[str, ...] = (), run: str = ""
            ) -> dict[str, np.ndarray]:
    """The global model plus this node's step, in the dtype it came in (a job's wire_dtype).
    With `layers` (the job's local_params): the node's own copy of the local tensors is
    stepped instead of the global model's, kept in `layers`, and left out of what returns."""
    tensors, _ = codec.decode(payload)
    if layers is not None:
        tensors = dict(tensors)
        layers.restore(tensors, patterns, run)
    scale = step_scale(index, header.round)
    out = {name: (g + noise.get(name, g.shape) * scale).astype(g.dtype, copy=False)
           for name, g in tensors.items()}
    return layers.keep(out, patterns) if layers is not None else out


def secure_change(noise: Noise, index: int, header: pb.TaskHeader, payload: memoryview,
                  layers: LocalLayers | None = None, patterns: tuple[str, ...] = (),
                  run: str = "") -> np.ndarray:
    """The same step alone, flat in the secure protocol's layout (sorted names); local
    tensors (`layers`) are stepped and kept on the node and are not in the vector, as the
    agent's masked vector covers the shared tensors only (node/secagg.py)."""
    tensors, _ = codec.decode(payload)
    scale = step_scale(index, header.round)
    if layers is not None:
        mine = dict(tensors)
        layers.restore(mine, patterns, run)
        layers.keep({name: (g + noise.get(name, g.shape) * scale).astype(g.dtype, copy=False)
                     for name, g in local_params.split(mine, patterns)[1].items()}, patterns)
        tensors = local_params.shared(tensors, patterns)
    return np.concatenate([(noise.get(name, tensors[name].shape) * scale).reshape(-1)
                           for name in sorted(tensors)]).astype(np.float32, copy=False)
