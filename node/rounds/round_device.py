"""The round worker's device and process: the device a round trains on (threads, the CUDA
device CUDA_VISIBLE_DEVICES left, its memory share), the seeds, the names and peak memory a
result reports. Shared by the star round (node/rounds/runner.py) and the ring
(node/ring_worker.py)."""

from __future__ import annotations

import math
import platform
import random
import resource
import sys

import numpy as np
import torch

from fedgpu.node.rounds.spec import BadInputError, RoundSpec

_MIB = 1 << 20


def rss_peak_mib() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return math.ceil(peak / (_MIB if sys.platform == "darwin" else 1024))


def prepare_device(spec: RoundSpec) -> torch.device:
    if spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    device = torch.device(spec.device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise BadInputError(
            f"task.json asks for {spec.device} but this torch build sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise BadInputError(
            f"task.json asks for {spec.device} but only {torch.cuda.device_count()} CUDA "
            f"device(s) are visible (CUDA_VISIBLE_DEVICES decides the numbering)"
        )
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    if spec.memory_fraction is not None:
        # Several nodes may share one card: the caching allocator refuses to grow past this
        # share and raises OutOfMemoryError instead of starving the neighbours.
        torch.cuda.set_per_process_memory_fraction(spec.memory_fraction, index)
    torch.cuda.reset_peak_memory_stats(device)
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too
    # cuDNN's autotuner picks kernels by timing, which changes results from run to run.
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({_cpu_model()})"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def ceil_mib(nbytes: int) -> int:
    # Rounded up: a small model's few hundred KiB must not read as "0 MiB, the GPU was idle".
    return math.ceil(nbytes / _MIB)
