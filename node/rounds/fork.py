"""A round's worker as the worker factory (node/rounds/factory.py) makes it: the request it runs,
the
checks that make a fork safe, the child's set-up, and the factory's warm-up.

The child reseeds every RNG (it starts from the factory's states), names itself fedgpu-round,
takes the round's environment whole (CUDA_VISIBLE_DEVICES and the memory cap before anything
touches CUDA, which torch initialises lazily), starts its own torch thread pool, ends with the
factory (PR_SET_PDEATHSIG), and then runs the round exactly as `python -m fedgpu.node.rounds.worker`
would. Torch is imported inside the functions: the agent imports this module's neighbours.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedgpu.core import lifetime
from fedgpu.node.rounds.slots import Need

log = logging.getLogger("fedgpu.factory")

# Read when numpy's OpenBLAS loads, so set before numpy is imported: its thread pool would
# otherwise start threads in the factory, and a fork with other threads alive is not safe.
# (torch's own pools start threads only when used with more than one; the factory uses one.)
SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1"}
MAX_ENV_ENTRIES = 4096
WORKER_NAME = b"fedgpu-round"
_PR_SET_NAME = 15


@dataclass(frozen=True)
class Spawn:
    """One validated spawn request."""

    workdir: Path
    env: dict[str, str]
    node: str
    need: Need
    torch_threads: int | None
    warm: dict[str, Any] | None


def parse_spawn(msg: dict[str, Any]) -> Spawn:
    """Check a spawn request field by field; every problem is a one-line ValueError."""
    workdir = msg.get("workdir")
    if not isinstance(workdir, str) or not os.path.isabs(workdir) or not os.path.isdir(workdir):
        raise ValueError(f"workdir must be an existing absolute directory, got {workdir!r}")
    env = msg.get("env")
    if (not isinstance(env, dict) or len(env) > MAX_ENV_ENTRIES
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError(f"env must be an object of at most {MAX_ENV_ENTRIES} strings")
    node = msg.get("node", "")
    if not isinstance(node, str) or len(node) > 200:
        raise ValueError("node must be a string of at most 200 characters")
    device = msg.get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    uuid = msg.get("gpu_uuid")
    share = msg.get("gpu_share")
    if uuid is not None and not isinstance(uuid, str):
        raise ValueError("gpu_uuid must be a string or null")
    if share is not None and (isinstance(share, bool) or not isinstance(share, int | float)
                              or not 0 < share <= 1):
        raise ValueError(f"gpu_share must be in (0, 1] or null, got {share!r}")
    threads = msg.get("torch_threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"torch_threads must be a positive integer or null, got {threads!r}")
    warm = msg.get("warm")
    if warm is not None and not isinstance(warm, dict):
        raise ValueError("warm must be an object or null")
    return Spawn(Path(workdir), dict(env), node, Need(device, uuid, share), threads, warm)


def thread_names() -> list[str]:
    """The names of this process's threads (the kernel's view: C threads too)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:
            continue
    return names


def cuda_touched() -> str | None:
    """Why a fork from here would hand the child a broken CUDA, or None."""
    import torch

    if torch.cuda.is_initialized():
        return "torch initialised CUDA in the factory"
    # The driver library being mapped is not a hazard: CUDA builds of torch 2.11 dlopen
    # libcuda.so at `import torch` (seen on an H200, cu130) without initialising it. What a
    # child cannot inherit is an initialised driver (cuInit: its threads, which fork_hazard's
    # thread count sees, and its device handles); torch.cuda.is_initialized covers torch's own.
    return None


def fork_hazard() -> str | None:
    """Why forking from this process now would be unsafe, or None."""
    names = thread_names()
    if len(names) > 1:
        return (f"the factory runs {len(names)} threads ({', '.join(names)}); forking is "
                "safe only from a single-threaded process")
    return cuda_touched()


def warm_up(hint: dict[str, Any] | None, warmed: set[str]) -> bool:
    """Once per task: one throw-away step on the CPU, so later workers inherit warm code.

    Only installed tasks (entry points), never code that came with a job. True when it ran.
    """
    name = (hint or {}).get("task_name")
    if not isinstance(name, str) or name in warmed:
        return False
    warmed.add(name)
    from fedgpu.node.rounds import worker
    from fedgpu.node.tasks import available_tasks

    if name not in available_tasks():
        return False
    started = time.monotonic()
    try:
        worker._warm_up(hint)
    except Exception as exc:  # a round reports a real problem; this only warms up
        log.warning("warm-up for task %r failed: %s", name, exc)
        return False
    log.info("warmed up task %r in %.2fs", name, time.monotonic() - started)
    return True


def run_worker(spawn: Spawn, factory_pid: int, threads: int) -> int:
    """The forked child's round, as `python -m fedgpu.node.rounds.worker WORKDIR` would run it."""
    os.environ.clear()
    os.environ.update(spawn.env)
    # Dies with the factory, even a SIGKILLed one (the factory kills it when its agent dies).
    os.environ[lifetime.PARENT_ENV] = str(factory_pid)
    lifetime.bind_to_parent()
    _name_process(WORKER_NAME)
    _reseed()
    import torch

    # A fresh intra-op pool in the child; the factory itself ran on one thread.
    torch.set_num_threads(threads)
    tag = f" [{spawn.node}]" if spawn.node else ""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")
    # Checked again in the child, where it matters: its CUDA must be its own.
    logging.getLogger("fedgpu.worker").info(
        "worker pid %d forked by the factory %d: CUDA initialised before the task: %s",
        os.getpid(), factory_pid, "yes" if torch.cuda.is_initialized() else "no")
    from fedgpu.node.rounds import worker

    return worker.run(spawn.workdir)


def _reseed() -> None:
    """Every child starts from the factory's RNG states; the round reseeds from its own seed,
    but nothing drawn before that may repeat across workers."""
    import numpy as np
    import torch

    seed = int.from_bytes(os.urandom(8), "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def _name_process(name: bytes) -> None:
    # `ps -o comm`, psutil's name() and top show the worker for what it is.
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def load_stack() -> int:
    """Import torch and the training stack single-threaded; the torch threads a worker would
    have had by default."""
    for key, value in SINGLE_THREADED.items():
        os.environ.setdefault(key, value)
    started = time.monotonic()
    import torch

    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from fedgpu.node.rounds import runner, worker  # noqa: F401 - imported once here, shared by forks

    worker._warm_up(None)
    gc.collect()
    # Objects that live as long as the factory stay out of the collector's sweeps, so a child's
    # collections do not write to (and so copy) the pages it shares with the factory.
    gc.freeze()
    log.info("imported torch %s and the training stack in %.1fs", torch.__version__,
             time.monotonic() - started)
    return default_threads
