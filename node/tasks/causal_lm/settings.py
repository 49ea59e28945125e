"""The `causal-lm` task's own hyperparameters, parsed once into a frozen record (no torch).

The runner takes its loop keys (batch_size, local_epochs, max_steps, amp, ...) out of the job's
hyperparameters first (node/switches.py); what is left is parsed here, strictly, so a typo such
as `lora_rank` for `lora_r` fails the round with the known keys instead of training silently.
Hyperparameters are scalars on the wire, so `target_modules` is a comma-separated string.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from fedgpu.node.tasks.base import HyperparameterError, resolve_hparams

TASK_NAME = "causal-lm"
_E = TypeVar("_E", bound=StrEnum)


class BaseDtype(StrEnum):
    """The dtype the frozen base weights are loaded in (adapters stay float32)."""

    AUTO = "auto"  # bfloat16 on a GPU that has it, else float32
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Quantization(StrEnum):
    """Loading the frozen base in 4 or 8 bits (bitsandbytes, CUDA only): QLoRA."""

    NONE = "none"
    INT8 = "8bit"
    NF4 = "4bit"


DEFAULTS: dict[str, int | float | bool | str] = {
    # A directory in Hugging Face format (config.json, *.safetensors, tokenizer files) on the
    # site; relative paths are resolved against the node's data directory by the agent.
    "model_dir": "",
    "dtype": BaseDtype.AUTO.value,
    "quantization": Quantization.NONE.value,
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    # "all-linear" (every linear layer but the output head), or module names such as
    # "q_proj,v_proj" (GPT-2: "c_attn,c_proj").
    "target_modules": "all-linear",
    # FFA-LoRA: A keeps its (shared, seeded) initial value and only B trains, so FedAvg of the
    # adapters is exactly the average of the updates B @ A (docs/explanation/language-models.md).
    "freeze_lora_a": False,
    "lr": 2e-4,
    "weight_decay": 0.0,
    "seq_len": 512,
    "text_field": "text",
    # With no test split on the site, every round(1 / eval_fraction)-th record is held out.
    "eval_fraction": 0.1,
    "gradient_checkpointing": False,
}
MAX_SEQ_LEN = 1 << 17
MAX_LORA_R = 4096


@dataclass(frozen=True)
class LmSettings:
    model_dir: Path
    dtype: BaseDtype
    quantization: Quantization
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: str | tuple[str, ...]
    freeze_lora_a: bool
    lr: float
    weight_decay: float
    seq_len: int
    text_field: str
    eval_fraction: float
    gradient_checkpointing: bool


def parse(given: Mapping[str, Any]) -> LmSettings:
    hp = resolve_hparams(TASK_NAME, given, DEFAULTS)
    if not hp["model_dir"].strip():
        raise HyperparameterError(
            f"task {TASK_NAME!r}: hyperparameter model_dir is required: the directory of the "
            f"base model in Hugging Face format on each site (e.g. model_dir = "
            f"\"/models/Mistral-7B-v0.3\"; 'fedgpu data synth-lm' writes a tiny one)")
    dtype = _choice("dtype", hp["dtype"], BaseDtype)
    quant = _choice("quantization", hp["quantization"], Quantization)
    if not 1 <= hp["lora_r"] <= MAX_LORA_R:
        _refuse("lora_r", hp["lora_r"], f"from 1 to {MAX_LORA_R}")
    if hp["lora_alpha"] <= 0:
        _refuse("lora_alpha", hp["lora_alpha"], "> 0")
    if not 0 <= hp["lora_dropout"] < 1:
        _refuse("lora_dropout", hp["lora_dropout"], "in [0, 1)")
    if hp["lr"] <= 0:
        _refuse("lr", hp["lr"], "> 0")
    if hp["weight_decay"] < 0:
        _refuse("weight_decay", hp["weight_decay"], ">= 0")
    if not 2 <= hp["seq_len"] <= MAX_SEQ_LEN:
        _refuse("seq_len", hp["seq_len"], f"from 2 to {MAX_SEQ_LEN}")
    if not 0 < hp["eval_fraction"] < 1:
        _refuse("eval_fraction", hp["eval_fraction"], "in (0, 1)")
    if not hp["text_field"]:
        _refuse("text_field", hp["text_field"], "a JSON key")
    modules = [m.strip() for m in hp["target_modules"].split(",") if m.strip()]
    if not modules:
        _refuse("target_modules", hp["target_modules"], "'all-linear' or module names")
    targets: str | tuple[str, ...] = (
        "all-linear" if modules == ["all-linear"] else tuple(modules))
    if "all-linear" in modules and len(modules) > 1:
        _refuse("target_modules", hp["target_modules"], "'all-linear' alone, or module names")
    return LmSettings(
        model_dir=Path(hp["model_dir"]).expanduser(),
        dtype=dtype,
        quantization=quant,
        lora_r=hp["lora_r"],
        lora_alpha=float(hp["lora_alpha"]),
        lora_dropout=hp["lora_dropout"],
        target_modules=targets,
        freeze_lora_a=hp["freeze_lora_a"],
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        seq_len=hp["seq_len"],
        text_field=hp["text_field"],
        eval_fraction=hp["eval_fraction"],
        gradient_checkpointing=hp["gradient_checkpointing"],
    )


def _choice(key: str, value: str, enum: type[_E]) -> _E:
    try:
        return enum(value)
    except ValueError:
        raise HyperparameterError(
            f"task {TASK_NAME!r}: hyperparameter {key} must be one of "
            f"{', '.join(e.value for e in enum)}, got {value!r}") from None


def _refuse(key: str, value: object, expected: str) -> None:
    raise HyperparameterError(
        f"task {TASK_NAME!r}: hyperparameter {key} must be {expected}, got {value!r}")
