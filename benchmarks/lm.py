"""causal-lm: bytes per round (adapters vs the full model), and a fedgpu round's training speed
against a plain transformers + peft loop on the same model and data.

    python -m benchmarks.lm                 # measure, print the Markdown section
    python -m benchmarks.lm --write         # as benchmarks/LM.md, copied into BENCHMARKS.md

Bytes: a real fedgpu round of the bench model (its update file, as the wire carries it), and
two models sized from their safetensors headers alone (memory.py reads them): a GPT-2 small
and a Mistral-7B-shaped header written on the fly, with FlowerTune's LoRA (r=32 on q_proj and
v_proj). A round moves the global adapters to each sampled node and one update back.

Speed: the same Llama-style model (randomly initialised, written by `fedgpu data synth-lm`
with a wider config), the same train.jsonl, batch, sequence length, LoRA config, AdamW and
1 torch thread on the CPU:
  plain   a fresh process: tokenise the file once, shuffle, and loop model(**batch).loss,
          backward, step — the loop anyone would write with transformers + peft
  fedgpu  `fedgpu run --nodes 1 --job ...` with max_steps = the plain loop's steps: the round
          goes through the aggregator, the agent, the worker factory and the runner's loop
          (node/rounds/loop.py), data streamed and tokenised by the task's Dataset
Tokens/s counts seq_len positions per sequence (padding included), the same for both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT

SECTION = "## Language models: LoRA adapters on the wire, and a round vs a plain transformers loop"
SEQ, BATCH, STEPS, THREADS, REPEATS = 128, 8, 24, 1, 3
LORA = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("FEDGPU_TOKEN", None)
    return env


def make_data(out: Path) -> Path:
    from fedgpu.cli.data.synth_lm import SynthLm, synth_lm

    # Wider and longer than the tests' model, so a step is compute, not Python overhead.
    synth_lm(out, SynthLm(nodes=1, records=STEPS * BATCH, test_records=16, words=SEQ,
                          vocab=1021, hidden=256, layers=4, heads=8), force=True)
    return out


def plain(data: Path, steps: int) -> dict[str, Any]:
    """The hand-written loop, in this (fresh) process."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model_dir = data / "model"
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    texts = [json.loads(line)["text"] for line in
             (data / "node-1" / "train.jsonl").read_text().splitlines() if line.strip()]
    enc = tok(texts, truncation=True, max_length=SEQ, padding="max_length", return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"],
                                            lora_dropout=0.0, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))
    model.train()
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        idx = order[(step * BATCH) % len(texts):][:BATCH]
        loss = model(input_ids=enc["input_ids"][idx], attention_mask=enc["attention_mask"][idx],
                     labels=labels[idx]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"steps": steps, "seconds": seconds, "tokens_per_s": steps * BATCH * SEQ / seconds,
            "cpu_seconds": cpu, "tokens_per_cpu_s": steps * BATCH * SEQ / cpu,
            "loss": float(loss)}


def runner_round(data: Path, steps: int) -> dict[str, Any]:
    """One train round through the runner, in this (fresh) process: what a round's worker runs
    once the agent has handed it the task (node/rounds/runner.py, node/rounds/loop.py)."""
    from fedgpu.node import weights
    from fedgpu.node.rounds import loop, runner
    from fedgpu.node.rounds.workfiles import WEIGHTS_IN, WEIGHTS_OUT

    # CPU time of the training loop alone (the round also builds, loads and evaluates): the
    # process's own CPU seconds move far less than wall time when other work shares the CPUs.
    cpu: list[float] = []
    train = loop.Loop.train

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = time.process_time()
        try:
            return train(self, *args, **kwargs)
        finally:
            cpu.append(time.process_time() - before)

    loop.Loop.train = timed  # type: ignore[method-assign]

    work = Path(tempfile.mkdtemp(prefix="fedgpu-bench-lm-round-"))
    try:
        def spec(kind: str) -> runner.RoundSpec:
            return runner.parse_spec({
                "kind": kind, "task_name": "causal-lm", "seed": 0, "round": 1,
                "hyperparameters": _hparams(data / "model", steps),
                "data_dir": str(data / "node-1"), "device": "cpu", "torch_threads": THREADS})

        (work / "init").mkdir()
        runner.run_round(spec("init"), work / "init")
        (work / "train").mkdir()
        weights.write_weights(work / "train" / WEIGHTS_IN,
                              weights.read_arrays(work / "init" / WEIGHTS_OUT))
        result = runner.run_round(spec("train"), work / "train")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    m = result.train_metrics
    tokens = int(m["steps"]) * BATCH * SEQ
    return {"steps": int(m["steps"]), "seconds": result.train_seconds,
            "tokens_per_s": m["examples_per_s"] * SEQ, "cpu_seconds": cpu[0],
            "tokens_per_cpu_s": tokens / cpu[0], "loss": m["loss"]}


def _hparams(model_dir: Path | str, steps: int) -> dict[str, Any]:
    return {"model_dir": str(model_dir), "lr": 1e-3, "seq_len": SEQ, "batch_size": BATCH,
            "max_steps": steps, "local_epochs": 1000, **LORA}


def fedgpu_round(data: Path, steps: int, work: Path) -> list[dict[str, Any]]:
    job = work / "job.toml"
    hp = _hparams("../model", steps)
    job.write_text("\n".join([
        'task = "causal-lm"', "rounds = 2", "min_nodes = 1", "use_gpu = false",
        "round_deadline_s = 900", "", "[hyperparameters]",
        *(f"{k} = {json.dumps(v)}" for k, v in hp.items())]) + "\n")
    run_dir = work / "run"
    r = subprocess.run([sys.executable, "-m", "fedgpu.cli.app", "run", "--job", str(job),
                        "--data", str(data), "--nodes", "1", "--run-dir", str(run_dir),
                        "--torch-threads", str(THREADS), "--gpu", "none"],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"fedgpu run failed:\n{r.stdout}\n{r.stderr}")
    rounds = json.loads((run_dir / "rounds.json").read_text())["rounds"]
    out = []
    for rec in rounds:
        (u,) = rec["updates"]
        m = u["train_metrics"]
        out.append({"round": rec["round"], "steps": int(m["steps"]),
                    "train_seconds": u["resources"]["train_seconds"],
                    "tokens_per_s": m["examples_per_s"] * SEQ,
                    "round_seconds": rec["duration_s"], "bytes_received": rec["bytes_received"],
                    "first_step_s": m["first_step_s"]})
    return out


def _header_dir(root: Path, config: dict[str, int], tensors: dict[str, list[int]],
                dtype: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    header = {n: {"dtype": dtype, "shape": s, "data_offsets": [0, 0]} for n, s in tensors.items()}
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return root


def sized_models(work: Path) -> list[dict[str, Any]]:
    """Adapter vs full-model bytes of two known shapes, from headers only."""
    from fedgpu.node.tasks.causal_lm import memory

    out = []
    h, i, v, n, kv = 4096, 14336, 32768, 32, 1024
    mistral = {"model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h],
               "model.norm.weight": [h]}
    for k in range(n):
        p = f"model.layers.{k}."
        mistral |= {p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                    p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                    p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                    p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
                    p + "post_attention_layernorm.weight": [h]}
    d = _header_dir(work / "mistral", {"num_hidden_layers": n, "hidden_size": h,
                                       "vocab_size": v}, mistral, "BF16")
    facts = memory.model_facts(d)
    lora = memory.lora_parameters(facts, ("q_proj", "v_proj"), 32)
    out.append({"model": "Mistral-7B shape, bf16, LoRA r=32 on q_proj,v_proj (FlowerTune)",
                "parameters": facts.parameters, "full_bytes": facts.stored_bytes,
                "lora_parameters": lora, "adapter_bytes": lora * 4})
    h, n, v = 768, 12, 50257
    gpt2 = {"transformer.wte.weight": [v, h], "transformer.wpe.weight": [1024, h]}
    for k in range(n):
        p = f"transformer.h.{k}."
        gpt2 |= {p + "attn.c_attn.weight": [h, 3 * h], p + "attn.c_proj.weight": [h, h],
                 p + "mlp.c_fc.weight": [h, 4 * h], p + "mlp.c_proj.weight": [4 * h, h]}
    d = _header_dir(work / "gpt2", {"n_layer": n, "n_embd": h, "vocab_size": v}, gpt2, "F32")
    facts = memory.model_facts(d)
    lora = memory.lora_parameters(facts, ("c_attn",), 8)
    out.append({"model": "GPT-2 small shape, float32, LoRA r=8 on c_attn",
                "parameters": facts.parameters, "full_bytes": facts.stored_bytes,
                "lora_parameters": lora, "adapter_bytes": lora * 4})
    return out


def measure() -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="fedgpu-bench-lm-"))
    try:
        load_before = os.getloadavg()[0]
        data = make_data(work / "data")
        full_bytes = (data / "model" / "model.safetensors").stat().st_size

        def fresh(mode: str) -> dict[str, Any]:
            r = subprocess.run([sys.executable, "-m", "benchmarks.lm", mode, str(data)],
                               capture_output=True, text=True, env=_env(), cwd=ROOT,
                               timeout=1800)
            if r.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{r.stderr}")
            return json.loads(r.stdout.strip().splitlines()[-1])

        # Interleaved, each in a fresh process, so a change of load on the shared machine
        # hits both sides; the best of each is compared.
        plains, runs = [], []
        for _ in range(REPEATS):
            plains.append(fresh("--plain"))
            runs.append(fresh("--runner"))
        rounds = fedgpu_round(data, STEPS, work)
        return {
            "machine": _machine(), "load": [load_before, os.getloadavg()[0]],
            "bench_model_full_bytes": full_bytes, "plain": plains, "runner": runs,
            "fedgpu": rounds,
            "sized": sized_models(work),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _machine() -> str:
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    import peft

    return (f"{cpu}, {os.cpu_count()} logical CPUs; torch {torch.__version__}, transformers "
            f"{transformers.__version__}, peft {peft.__version__}")


def markdown(doc: dict[str, Any]) -> str:
    plain_best = max(p["tokens_per_s"] for p in doc["plain"])
    runner_best = max(r["tokens_per_s"] for r in doc["runner"])
    fed_best = max(r["tokens_per_s"] for r in doc["fedgpu"])
    plain_worst = min(p["tokens_per_s"] for p in doc["plain"])
    plain_cpu = max(p["tokens_per_cpu_s"] for p in doc["plain"])
    runner_cpu = max(r["tokens_per_cpu_s"] for r in doc["runner"])
    ratio = runner_cpu / plain_cpu
    update = doc["fedgpu"][0]["bytes_received"]
    full = doc["bench_model_full_bytes"]
    lines = [
        SECTION, "",
        f"`python -m benchmarks.lm`: the causal-lm task (transformers + peft, LoRA r=8, alpha "
        f"16, all-linear) on a randomly initialised Llama of 4 layers, hidden 256, vocabulary "
        f"1025 (`fedgpu data synth-lm` with a wider config), batch {BATCH} x {SEQ} tokens, "
        f"AdamW, float32, {THREADS} torch thread, CPU.",
        "",
        f"- Machine: {doc['machine']}. 1-minute load average before / after: "
        f"{doc['load'][0]:.1f} / {doc['load'][1]:.1f} (the CPUs are shared with other work: "
        f"tokens/s move by tens of percent between runs at such load).",
        "",
        "### Bytes per round",
        "",
        "A round sends the global adapters to each sampled node and takes one update back from "
        "each: 2 x nodes x the payload below. The base model never travels.",
        "",
        "| model | parameters | full model | adapters (float32) | adapters / full |",
        "|---|---|---|---|---|",
        f"| bench model, measured (one update as the aggregator received it) | - | "
        f"{_mb(full)} | {_mb(update)} | {update / full:.1%} |",
    ]
    for s in doc["sized"]:
        lines.append(f"| {s['model']} | {s['parameters'] / 1e6:,.0f}M | {_mb(s['full_bytes'])}"
                     f" | {_mb(s['adapter_bytes'])} | {s['adapter_bytes'] / s['full_bytes']:.2%}"
                     f" |")
    lines += [
        "",
        "FlowerTune's 20 clients at 10% a round move 2 x 2 x 52 MiB = 208 MiB a round with "
        "adapters; the same rounds with the full bf16 model would move 54 GiB.",
        "",
        "### Training speed: a fedgpu round vs a plain transformers + peft loop",
        "",
        "| | steps | train seconds | tokens/s | % of the best plain run | training CPU seconds |"
        " tokens per CPU second | % of the best plain run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (p, r) in enumerate(zip(doc["plain"], doc["runner"], strict=True)):
        for name, x in ((f"plain loop, run {i + 1}", p), (f"fedgpu round (runner), run {i + 1}",
                                                          r)):
            lines.append(f"| {name} | {x['steps']} | {x['seconds']:.2f} | "
                         f"{x['tokens_per_s']:,.0f} | {x['tokens_per_s'] / plain_best:.0%} | "
                         f"{x['cpu_seconds']:.2f} | {x['tokens_per_cpu_s']:,.0f} | "
                         f"{x['tokens_per_cpu_s'] / plain_cpu:.0%} |")
    for r in doc["fedgpu"]:
        lines.append(f"| `fedgpu run --nodes 1`, round {r['round']} (round wall time "
                     f"{r['round_seconds']:.1f} s) | {r['steps']} | {r['train_seconds']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / plain_best:.0%} "
                     f"| - | - | - |")
    verdict = "met" if ratio >= 0.95 else "not met"
    lines += [
        "",
        f"Best fedgpu round / best plain run, in tokens per CPU second of the training loop: "
        f"**{ratio:.0%}** (target >= 95%: {verdict}). In wall-clock tokens/s, which the load "
        f"on this shared machine moves by tens of percent from one run to the next (the plain "
        f"loop's own runs spread from {plain_worst / plain_best:.0%} to 100%): best runner "
        f"round {runner_best / plain_best:.0%}, best round through a "
        f"whole local federation (aggregator, agent, worker factory sharing the CPUs) "
        f"{fed_best / plain_best:.0%} of the best plain run. "
        f"`fedgpu round (runner)` is a round's worker code in a fresh process "
        f"(node/rounds/runner.py: the model and the adapters built, the global adapters loaded, "
        f"the held-out split evaluated, then the runner's loop: a DataLoader over the task's "
        f"streaming Dataset, records read and tokenised per item); tokens/s is its loop's. The "
        f"plain loop tokenises the whole file up front. The round wall time adds what a round "
        f"costs beyond training: the evaluation, loading the base model in a fresh worker, and "
        f"the update's trip. A GPU run (bf16 autocast, a real model) uses the same command on "
        f"a CUDA host.",
        "",
    ]
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MiB"


def write_section(text: str, path: Path = ROOT / "benchmarks" / "LM.md") -> None:
    """The section as benchmarks/LM.md (headings one level up), then BENCHMARKS.md again from
    run_all's results with it (benchmarks/report.py copies the separately measured files in)."""
    from benchmarks.report import render

    lines = [line[1:] if line.startswith("##") else line for line in text.splitlines()]
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    (ROOT / "BENCHMARKS.md").write_text(render(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--runner", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--write", action="store_true", help="write benchmarks/LM.md and BENCHMARKS.md")
    ap.add_argument("--json", type=Path, help="also keep the measurements here")
    a = ap.parse_args()
    if a.plain is not None:
        print(json.dumps(plain(a.plain, STEPS)))
        return
    if a.runner is not None:
        print(json.dumps(runner_round(a.runner, STEPS)))
        return
    doc = measure()
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    print(text)
    if a.write:
        write_section(text)
    assert math.isfinite(doc["plain"][0]["tokens_per_s"])


if __name__ == "__main__":
    main()
