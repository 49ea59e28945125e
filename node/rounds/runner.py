"""One round of local work — init, train or evaluate — from a parsed task.json to a result.

Kept apart from `node/rounds/worker.py` (the process entry point) so tests can run a round
in-process.
The runner owns the device: it builds the model under `torch.device(device)` and loads the
global weights into it there. For a tensor task it moves the task's data onto the device once
and calls the task's own loops; for a Dataset task it drives the loops itself (node/rounds/loop.py).
Either way it applies the GPU switches of node/rounds/switches.py; task code never moves tensors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from fedgpu.core import codec, local_params
from fedgpu.core.bundles import BundleError
from fedgpu.node import weights
from fedgpu.node.data import DataDirError, check_data_dir
from fedgpu.node.rounds import compress, ddp, dp_sgd, local_dp, local_state, site_statistics
from fedgpu.node.rounds.loop import Loop, autocast
from fedgpu.node.rounds.round_device import (
    ceil_mib,
    device_name,
    prepare_device,
    rss_peak_mib,
    seed_everything,
)
from fedgpu.node.rounds.spec import (  # noqa: F401 - parse_spec: named here for its callers
    BadInputError,
    RoundSpec,
    parse_spec,
)
from fedgpu.node.rounds.switches import Switches, for_device, split_hparams
from fedgpu.node.rounds.workfiles import (
    EXIT_CODES,
    WEIGHTS_IN,
    WEIGHTS_OUT,
    ErrorKind,
)
from fedgpu.node.tasks import (
    Datasets,
    DatasetTask,
    HyperparameterError,
    Task,
    TaskLoadError,
    UnknownTaskError,
    load_task,
)
from fedgpu.node.tasks.bundled import load_bundle_task

log = logging.getLogger("fedgpu.worker")


class DivergedError(RuntimeError):
    """Training produced NaN or infinite weights."""


@dataclass
class RoundResult:
    num_examples: int = 0
    train_metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    num_eval_examples: int = 0
    torch_peak_allocated_mib: int = -1
    torch_peak_reserved_mib: int = -1
    rss_peak_mib: int = 0
    train_seconds: float = 0.0
    device_name: str = ""
    # A statistics round: the columns' exact summaries (node/rounds/site_statistics.py).
    statistics: list[dict[str, Any]] | None = None
    # Data-parallel workers: each rank's training time, in rank order (rank 0's result only).
    rank_train_seconds: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Failure:
    kind: ErrorKind
    message: str

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]


def task_for(spec: RoundSpec, workdir: Path) -> Task | DatasetTask:
    """The round's task: installed (by name), or imported from its checked bundle here."""
    if spec.bundle is not None:
        return load_bundle_task(spec.bundle, workdir)
    return load_task(spec.task_name)


def run_round(spec: RoundSpec, workdir: Path) -> RoundResult:
    """Do the round's work; reads WEIGHTS_IN and writes WEIGHTS_OUT inside `workdir`."""
    workdir = Path(workdir)
    started = time.perf_counter()
    device = prepare_device(spec)
    if spec.ddp is None:
        return _run_round(spec, workdir, device, started)
    if dp_sgd.split_dp(spec.task_name, spec.hyperparameters)[0] is not None:
        raise BadInputError("workers > 1 with DP-SGD (hyperparameter dp_sgd) is not supported")
    ddp.start(spec.ddp, device)
    try:
        return _run_round(spec, workdir, device, started)
    finally:
        ddp.stop()


def _run_round(spec: RoundSpec, workdir: Path, device: torch.device,
               started: float) -> RoundResult:
    seed_everything(spec.seed)
    task = task_for(spec, workdir)
    if spec.kind == "statistics":
        return _statistics_round(spec, task, device)
    streaming, train = isinstance(task, DatasetTask), spec.kind == "train"
    dp, hparams = dp_sgd.split_dp(spec.task_name, spec.hyperparameters)
    hparams = dict(hparams)
    ask = compress.take(hparams)  # update_codec: the job wants a compressed delta back
    local = local_state.take(hparams)  # local_params: tensors that stay at this site
    local_path = (local_state.path_for(local, spec.local_state_dir, workdir)
                  if local is not None else None)
    switches, loop, task_hp = split_hparams(spec.task_name, hparams, streaming)
    switches = for_device(spec.task_name, switches, device.type, owns_loop=streaming)
    if dp is not None:
        switches = dp_sgd.dp_switches(spec.task_name, switches)
    if switches.cudnn_benchmark:
        # Asked for by the job: speed over run-to-run reproducibility of the kernels chosen.
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.deterministic = False
    if spec.kind != "init":
        if spec.data_dir is None:
            raise BadInputError("task.json: 'data_dir' is required for train and evaluate")
        # Only that it exists: which files it must hold is the task's business.
        check_data_dir(spec.data_dir, required=())
    result = RoundResult(device_name=device_name(device))

    with torch.device(device):
        model = task.build_model(task_hp)
        if dp is not None:
            model = dp_sgd.prepare_model(spec.task_name, model, dp)
    private = dp_sgd.PrivateTraining(spec.task_name, dp, spec.round) if dp and train else None
    wire_dtypes: dict[str, str] | None = None
    restored = 0  # the site's own tensors put over the global model's (local_params)
    if spec.kind != "init":
        assert spec.data_dir is not None
        arrays = weights.read_arrays(workdir / WEIGHTS_IN)
        wire_dtypes = {name: codec.dtype_name(arr.dtype) for name, arr in arrays.items()}
        if local is not None and local_path is not None:
            # The site's own layers over the global model's: evaluation scores them too. They
            # never travel, so they stay in the model's precision, not the wire's.
            wire_dtypes = local_params.shared(wire_dtypes, local.patterns)
            restored = local_state.restore(arrays, local, local_path)
        weights.load_into(model, arrays)
        del arrays
        if switches.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if streaming:
            assert loop is not None
            _stream_round(spec, task, model, device, Loop(task, model, device, loop, switches,
                                                          task_hp, private, spec.ddp),
                          result, started)
        else:
            _tensor_round(spec, task, model, device, switches, task_hp, result,  # type: ignore[arg-type]
                          private)
        if local is not None:  # how many of the site's own tensors this round used
            result.train_metrics["local_tensors"] = float(restored)
        if switches.channels_last:
            # Back to the layout the wire and every other node expect (row-major NCHW).
            model = model.to(memory_format=torch.contiguous_format)

    if spec.ddp is not None and spec.kind == "train":
        _combine_ranks(spec.ddp, device, result)
    if spec.kind in ("init", "train") and (spec.ddp is None or spec.ddp.leader):
        bad = weights.non_finite(model)
        if bad:
            raise DivergedError(
                f"training diverged: {len(bad)} tensor(s) hold NaN/inf (first: {bad[0]}); "
                f"lower 'lr' in the job's hyperparameters"
            )
        out = weights.state_arrays(model, wire_dtypes)
        meta = {"task": spec.task_name, "round": str(spec.round)}
        base: Path | dict[str, np.ndarray] = workdir / WEIGHTS_IN
        if local is not None and local_path is not None and train:
            # Saved here, left out of the update: DP clips and the codec compresses the rest.
            out = local_state.keep(out, local, local_path, meta)
            base = local_params.shared(weights.read_arrays(workdir / WEIGHTS_IN),
                                       local.patterns)
        if spec.privacy is not None and train:  # clipped and noised before it is written
            out = local_dp.privatize(out, base, spec.privacy, result.train_metrics)
        if ask is not None and train:
            encoded = compress.write_delta(
                workdir / WEIGHTS_OUT, ask,
                base if isinstance(base, dict) else weights.read_arrays(base), out,
                compress.residual_path(workdir, spec.data_dir), meta)
            result.train_metrics["update_bytes"] = float(encoded.size)
        else:
            weights.write_weights(workdir / WEIGHTS_OUT, out, meta)

    if device.type == "cuda":
        result.torch_peak_allocated_mib = ceil_mib(torch.cuda.max_memory_allocated(device))
        result.torch_peak_reserved_mib = ceil_mib(torch.cuda.max_memory_reserved(device))
    result.rss_peak_mib = rss_peak_mib()
    return result


def _statistics_round(spec: RoundSpec, task: Task | DatasetTask,
                      device: torch.device) -> RoundResult:
    """No model: the task's columns summarised (their release is the agent's)."""
    if spec.data_dir is None:
        raise BadInputError("task.json: 'data_dir' is required for statistics")
    check_data_dir(spec.data_dir, required=())
    _, _, task_hp = split_hparams(spec.task_name, dict(spec.hyperparameters),
                                  isinstance(task, DatasetTask))
    try:
        columns, records, seconds = site_statistics.summaries(task, spec.task_name,
                                                              spec.data_dir, task_hp)
    except site_statistics.NoStatisticsError as exc:
        raise BadInputError(str(exc)) from None
    result = RoundResult(device_name=device_name(device), num_examples=records,
                         train_seconds=round(seconds, 4), statistics=columns)
    result.rss_peak_mib = rss_peak_mib()
    return result


def _stream_round(spec: RoundSpec, task: DatasetTask, model: torch.nn.Module,
                  device: torch.device, loop: Loop, result: RoundResult, started: float) -> None:
    assert spec.data_dir is not None
    sets = task.load_datasets(spec.data_dir, loop.hparams)
    if not isinstance(sets, Datasets):
        raise TypeError(f"task {spec.task_name!r}: load_datasets must return "
                        f"fedgpu.node.tasks.Datasets(train, test), got {type(sets).__name__}")
    for ds in (sets.train, sets.test):
        # Shuffling, the example count FedAvg weighs by and the step caps need a length.
        if isinstance(ds, IterableDataset) or not hasattr(ds, "__len__"):
            raise TypeError(f"task {spec.task_name!r}: load_datasets must return map-style "
                            f"Datasets (__len__ and __getitem__), got {type(ds).__name__}")
    # Evaluating first scores the model every node just received: the global model of the
    # previous round, on each node's own held-out split, where training runs (by rank 0 of
    # data-parallel workers: its update carries the site's figures).
    if spec.ddp is None or spec.ddp.leader:
        result.num_eval_examples, result.eval_metrics = loop.evaluate(sets.test)
        derived = getattr(task, "eval_metrics", None)
        if callable(derived):  # optional: metrics from the loop's (causal-lm: perplexity)
            result.eval_metrics.update(derived(result.eval_metrics))
    if spec.kind == "train":
        out = loop.train(sets.train, spec.seed, started)
        result.num_examples, result.train_metrics = out.num_examples, out.metrics
        result.train_seconds = out.seconds
        log.info("round %s: %d steps, %.0f examples/s, first step %.2fs after the round began",
                 spec.round, out.metrics["steps"], out.metrics["examples_per_s"],
                 out.metrics["first_step_s"])


def _tensor_round(spec: RoundSpec, task: Task, model: torch.nn.Module, device: torch.device,
                  switches: Switches, task_hp: dict[str, Any], result: RoundResult,
                  private: dp_sgd.PrivateTraining | None = None) -> None:
    assert spec.data_dir is not None
    data = {k: _to_device(v, device, switches.channels_last)
            for k, v in task.load_data(spec.data_dir).items()}
    # The task's loops run on the compiled module when asked; it shares `model`'s parameters.
    fwd = torch.compile(model) if switches.compile else model
    with autocast(device, switches):
        if spec.ddp is None or spec.ddp.leader:
            result.num_eval_examples, result.eval_metrics = task.evaluate(
                fwd, data, device, task_hp  # type: ignore[arg-type]
            )
        if spec.kind == "train":
            start = time.perf_counter()
            if spec.ddp is not None:
                out = ddp.train_tensor_task(task, model, ddp.wrap(model, device), data, device,
                                            task_hp, spec.seed, spec.ddp)
            elif private is not None:
                out = dp_sgd.train_tensor_task(task, model, data, device, task_hp, private)
            else:
                out = task.train(fwd, data, device, task_hp, spec.seed)  # type: ignore[arg-type]
            result.num_examples, result.train_metrics = out
            if device.type == "cuda":
                # Kernels run asynchronously; without this the clock stops before they finish.
                torch.cuda.synchronize(device)
            result.train_seconds = round(time.perf_counter() - start, 4)
            seen = result.train_metrics.get("examples")
            if seen is not None and "examples_per_s" not in result.train_metrics:
                # The Dataset loop reports it itself; a tensor task's own loop cannot know the
                # clock the runner keeps, and operators compare sites' speed by it.
                result.train_metrics["examples_per_s"] = round(
                    seen / max(result.train_seconds, 1e-9), 1)


def _combine_ranks(spec_ddp: ddp.Ddp, device: torch.device, result: RoundResult) -> None:
    """The site's training figures from every rank's: examples and losses summed, each
    rank's training time kept (the round's device-seconds)."""
    result.train_metrics = ddp.combine_metrics(result.train_metrics, device)
    result.rank_train_seconds = ddp.gather_seconds(result.train_seconds, device)
    if "examples_per_s" in result.train_metrics:
        slowest = max(result.rank_train_seconds)
        result.train_metrics["examples_per_s"] = round(
            result.train_metrics.get("examples", 0.0) / max(slowest, 1e-9), 1)


def _to_device(t: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    if channels_last and t.dim() == 4:
        return t.to(device, memory_format=torch.channels_last)
    return t.to(device)


def classify(exc: BaseException) -> Failure:
    """What the agent is told about a failed round: a kind and one line with the fix."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return Failure(
            "oom",
            f"CUDA out of memory ({_one_line(exc)}): lower 'batch_size' in the job's "
            f"hyperparameters, raise --gpu-memory-fraction if it caps this node, or pick a GPU "
            f"with more free memory (--gpu-index)",
        )
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    ):
        return Failure(
            "oom",
            f"host out of memory ({_one_line(exc)}): lower 'batch_size' or give the node "
            f"more RAM",
        )
    bad_input = (
        BadInputError,
        local_dp.LocalDpError,
        BundleError,
        UnknownTaskError,
        HyperparameterError,
        DataDirError,
        weights.WeightsError,
        codec.CodecError,
        local_state.LocalStateError,
    )
    if isinstance(exc, bad_input):
        return Failure("bad_input", _one_line(exc))
    if isinstance(exc, TaskLoadError | DivergedError):
        return Failure("exception", _one_line(exc))
    return Failure("exception", f"{type(exc).__name__}: {_one_line(exc)}")


def _one_line(exc: BaseException) -> str:
    raw = str(exc)
    if "Original Traceback" in raw:
        # Raised in a DataLoader worker: torch re-raises it here with the worker's whole
        # traceback as the message; its last line is the original "Type: message".
        last = raw.strip().splitlines()[-1]
        raw = last.split(": ", 1)[-1] + " (in a DataLoader worker)"
    text = " ".join(raw.split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."
