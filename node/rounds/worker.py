"""The per-round training process: `python -m fedgpu.node.rounds.worker WORKDIR`, or `run(WORKDIR)`
in a
process the worker factory forked (node/rounds/factory.py).

A process of its own for every round, so CUDA is initialised here and never in the agent (nor
in the factory), and all GPU memory of the round goes back to the driver when this process
exits. The file
contract (task.json in; result.json + weights.out.safetensors, or error.json, out) is described
in node/rounds/workfiles.py. Exit status: 0 ok, 1 exception, 2 bad input, 3 out of memory.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from fedgpu.core import lifetime
from fedgpu.node.rounds.workfiles import (
    ERROR_FILE,
    EXIT_BAD_INPUT,
    EXIT_EXCEPTION,
    EXIT_OK,
    RESULT_FILE,
    TASK_FILE,
    write_json,
)

log = logging.getLogger("fedgpu.worker")


def run(workdir: Path) -> int:
    """Run the round described in `workdir` and return the process exit status."""
    # Imported here, not at the top, so a torch that fails to import still yields error.json.
    try:
        from fedgpu.node.rounds import runner
    except Exception as exc:
        return _fail(workdir, "exception", f"cannot import the training stack: {exc}", exc)

    try:
        raw = json.loads((workdir / TASK_FILE).read_text())
    except (OSError, ValueError) as exc:
        return _fail(workdir, "bad_input", f"cannot read {workdir / TASK_FILE}: {exc}")
    try:
        spec = runner.parse_spec(raw)
        log.info(
            "round %s: %s task %r on %s (seed %s)",
            spec.round, spec.kind, spec.task_name, spec.device, spec.seed,
        )
        result = runner.run_round(spec, workdir)
    except Exception as exc:
        failure = runner.classify(exc)
        return _fail(workdir, failure.kind, failure.message, exc, failure.exit_code)
    write_json(workdir / RESULT_FILE, result.to_dict())
    log.info(
        "round %s done: %s examples, train %s, eval %s, torch peak %s MiB, %.2fs",
        spec.round, result.num_examples, result.train_metrics, result.eval_metrics,
        result.torch_peak_allocated_mib, result.train_seconds,
    )
    return EXIT_OK


def _fail(
    workdir: Path,
    kind: str,
    message: str,
    exc: BaseException | None = None,
    code: int | None = None,
    lost_ranks: list[int] | None = None,
) -> int:
    if kind == "bad_input":
        log.error("bad input: %s", message)
    else:
        # The agent gets error.json's one line; the traceback is for whoever reads the logs.
        log.error("%s: %s", kind, message, exc_info=exc)
    try:
        doc: dict[str, object] = {"error": message, "kind": kind}
        if lost_ranks:
            doc["lost_ranks"] = lost_ranks
        write_json(workdir / ERROR_FILE, doc)
    except OSError as err:
        log.error("cannot write %s: %s", workdir / ERROR_FILE, err)
    if code is not None:
        return code
    return EXIT_BAD_INPUT if kind == "bad_input" else EXIT_EXCEPTION


def _warm_up(hint: dict | None) -> None:
    """Pay the first-step costs (kernel set-up, allocator, autograd) before the round, on CPU
    (the worker factory does it once, and every worker it forks inherits the warm state).

    With a hint (the task of the previous round) one throw-away step of that task's own model
    on one batch of this node's data warms exactly the kernels the round will use; the round
    then builds its model afresh and re-seeds everything, so its result does not change.
    """
    import torch

    if hint and hint.get("task_name"):
        from fedgpu.node.rounds import compress, local_state
        from fedgpu.node.rounds.switches import split_hparams
        from fedgpu.node.tasks import DatasetTask, load_task

        task = load_task(str(hint["task_name"]))
        given = dict(hint.get("hyperparameters") or {})
        # The runner's own keys (local_params, update_codec), taken out before a task sees the
        # rest, as in the round itself.
        local_state.take(given)
        compress.take(given)
        custom = getattr(task, "warm_up", None)
        if callable(custom):
            # The task knows a cheaper warm-up than a step of its model (causal-lm: a base
            # model of billions of parameters must not be loaded on the CPU to warm imports).
            custom(given)
            return
        if isinstance(task, DatasetTask):
            _warm_up_streaming(task, given, hint.get("data_dir"))
            return
        _, _, hparams = split_hparams(task.name, given, streaming=False)  # the task's own keys
        with torch.device("cpu"):
            model = task.build_model(hparams)
        data_dir = hint.get("data_dir")
        if data_dir and all(hasattr(task, a) for a in ("batch_loss", "optimizer", "batch_size")):
            data = task.load_data(Path(data_dir))
            idx = torch.arange(min(task.batch_size(hparams), task.train_size(data)))
            if _backward_keeps_cuda_untouched():
                loss, _ = task.batch_loss(model, data, idx)
                loss.backward()
                task.optimizer(model, hparams).step()
            model.eval()
            with torch.no_grad():
                task.batch_loss(model, data, idx)
        return
    x = torch.randn(8, 1, 8, 8, requires_grad=True)
    conv = torch.nn.Conv2d(1, 4, 3, padding=1)
    out = torch.nn.Linear(4 * 8 * 8, 10)(torch.relu(conv(x)).flatten(1)).logsumexp(1).mean()
    if _backward_keeps_cuda_untouched():
        out.backward()


def _backward_keeps_cuda_untouched() -> bool:
    """Whether a warm-up may run backward. The first backward of a process starts autograd's
    per-device threads, and on a CUDA build of torch counting the devices initialises the
    CUDA driver (cuInit: a driver thread, device handles): a factory that did so cannot fork
    workers safely (seen on an H200, torch 2.11+cu130: every round then spawned a fresh
    worker). On such builds the warm-up stays forward-only."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _warm_up_streaming(task: Any, hparams: dict, data_dir: str | None) -> None:
    """A Dataset task: one step on two examples, through the runner's own loop code."""
    import torch

    from fedgpu.node.rounds.loop import Loop
    from fedgpu.node.rounds.switches import LoopSettings, Switches, split_hparams

    _, _, task_hp = split_hparams(task.name, hparams, streaming=True)
    with torch.device("cpu"):
        model = task.build_model(task_hp)
    if not data_dir:
        return
    sets = task.load_datasets(Path(data_dir), task_hp)
    two = torch.utils.data.Subset(sets.train, range(min(2, len(sets.train))))
    # No worker processes, no switches: this warms imports, Pillow and autograd on the CPU;
    # CUDA stays untouched until the round hands this process its GPU.
    loop = Loop(task, model, torch.device("cpu"), LoopSettings(batch_size=2, num_workers=0),
                Switches(), task_hp)
    if _backward_keeps_cuda_untouched():
        loop.train(two, seed=0, round_started=0.0)
    else:
        loop.evaluate(two)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The agent that started us may be SIGKILLed: then we stop too, instead of training on
    # for nobody (and holding the GPU).
    lifetime.bind_to_parent()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fedgpu.node.rounds.worker WORKDIR", file=sys.stderr)
        return EXIT_BAD_INPUT
    workdir = Path(args[0])
    if not workdir.is_dir():
        # No directory means nowhere to put error.json; the exit status and stderr must do.
        log.error("work directory %s does not exist", workdir)
        return EXIT_BAD_INPUT
    return run(workdir)


if __name__ == "__main__":
    # Every output is a file by now (lifetime.exit_now says why not the usual exit).
    lifetime.exit_now(main())
