"""The base model from its local directory, LoRA from peft, and a module whose state is the
adapters alone.

The runner reads and writes a model's weights through `state_dict()` (node/weights.py: the
global weights are copied into the tensors it returns, the update is read from them), and the
aggregator, the checkpoints and `fedgpu job model` only ever see what that returns. So
`AdapterModel.state_dict()` returns the LoRA tensors and nothing of the base model: that is the
whole of "only the adapters travel", with no special case anywhere else. Its names are peft's
saved-adapter names (`get_peft_model_state_dict`: the adapter name dropped), so a global model
written by `fedgpu job model` loads with `peft.set_peft_model_state_dict`.

Nothing is downloaded: `local_files_only=True` everywhere, and a missing file is an error
naming the directory.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fedgpu.node.tasks.base import HyperparameterError
from fedgpu.node.tasks.causal_lm.memory import ModelDirError, weight_files
from fedgpu.node.tasks.causal_lm.settings import BaseDtype, LmSettings, Quantization

log = logging.getLogger("fedgpu.worker")
ADAPTER = "default"
_TORCH_DTYPES = {BaseDtype.FLOAT32: torch.float32, BaseDtype.BFLOAT16: torch.bfloat16,
                 BaseDtype.FLOAT16: torch.float16}


class AdapterModel(nn.Module):
    """A peft model whose state (what is sent, averaged and checkpointed) is its adapters."""

    def __init__(self, peft_model: nn.Module) -> None:
        super().__init__()
        self.peft = peft_model
        # Wire name -> parameter name; "lora_" covers A/B, embedding A/B and DoRA's magnitude.
        self._wire = OrderedDict(
            (name.removeprefix("peft.").replace(f".{ADAPTER}", ""), name)
            for name, _ in self.named_parameters() if "lora_" in name
        )

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.peft(**batch)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:  # type: ignore[override]
        params = dict(self.named_parameters())
        out: OrderedDict[str, Any] = OrderedDict() if destination is None else destination
        for wire, name in self._wire.items():
            p = params[name]
            out[prefix + wire] = p if keep_vars else p.detach()
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False
                        ) -> Any:  # type: ignore[override]
        """Adapters by their wire names into the parameters (what state_dict returns)."""
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(mine))
        if strict and (missing or unexpected):
            raise RuntimeError(f"adapter state does not match: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, value in state_dict.items():
                if name in mine:
                    mine[name].copy_(value)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def adapter_parameters(self) -> Iterator[nn.Parameter]:
        params = dict(self.named_parameters())
        return (params[name] for name in self._wire.values())

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def base_dtype(s: LmSettings, device: torch.device) -> torch.dtype:
    if s.dtype is not BaseDtype.AUTO:
        return _TORCH_DTYPES[s.dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    # On a CPU half-precision matmuls are slow or missing; the job's amp = "bf16" still
    # autocasts the forward pass where the CPU has it.
    return torch.float32


def load(s: LmSettings) -> AdapterModel:
    """Base model + LoRA, on the runner's device (the torch.device context build_model runs in).
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load in every round's log helps no one
    device = torch.get_default_device()
    try:
        weight_files(s.model_dir)
    except ModelDirError as exc:
        raise HyperparameterError(f"task 'causal-lm': {exc}") from None
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": base_dtype(s, device)}
    if s.quantization is not Quantization.NONE:
        kwargs["quantization_config"] = _bnb_config(s, device)
        kwargs["device_map"] = {"": device.index or 0}
    else:
        kwargs["device_map"] = {"": device}
    try:
        base = AutoModelForCausalLM.from_pretrained(str(s.model_dir), **kwargs)
    except (OSError, ValueError) as exc:
        raise HyperparameterError(f"task 'causal-lm': cannot load the base model from "
                                  f"{s.model_dir}: {exc}") from None
    positions = getattr(base.config, "max_position_embeddings", None) or getattr(
        base.config, "n_positions", None)
    if isinstance(positions, int) and s.seq_len > positions:
        raise HyperparameterError(f"task 'causal-lm': seq_len {s.seq_len} is longer than the "
                                  f"{positions} positions {s.model_dir.name} was built for")
    # The base is frozen: no gradient for it, ever (peft also does this; being explicit keeps
    # the optimizer and the memory estimate honest when a task subclasses this).
    base.requires_grad_(False)
    base.config.use_cache = False  # a KV cache is for generation, and conflicts with checkpointing
    if s.quantization is not Quantization.NONE:
        base = prepare_model_for_kbit_training(
            base, use_gradient_checkpointing=s.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif s.gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(
        r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout,
        target_modules=s.target_modules if isinstance(s.target_modules, str)
        else list(s.target_modules),
        bias="none", task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(base, config, adapter_name=ADAPTER)
    except ValueError as exc:
        # e.g. target modules that the architecture does not have.
        raise HyperparameterError(f"task 'causal-lm': LoRA cannot wrap this model: "
                                  f"{exc}") from None
    model = AdapterModel(peft_model)
    if s.freeze_lora_a:
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_embedding_A." in name:
                p.requires_grad_(False)
    n_adapter = sum(p.numel() for p in model.adapter_parameters())
    n_all = sum(p.numel() for p in model.parameters())
    log.info("causal-lm: %s, %d adapter parameters (%.3f%% of %d), base %s",
             s.model_dir.name, n_adapter, 100 * n_adapter / max(n_all, 1), n_all,
             kwargs["dtype"])
    return model


def _bnb_config(s: LmSettings, device: torch.device) -> Any:
    if device.type != "cuda":
        raise HyperparameterError(
            f"task 'causal-lm': quantization = {s.quantization.value!r} needs a CUDA GPU "
            f"(bitsandbytes); this round runs on {device.type}: set quantization = \"none\" "
            f"or give the job [resources] gpu = \"required\"")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise HyperparameterError(
            f"task 'causal-lm': quantization = {s.quantization.value!r} needs bitsandbytes, "
            f"which is not installed on this site (pip install bitsandbytes)") from None
    from transformers import BitsAndBytesConfig

    if s.quantization is Quantization.INT8:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)


def load_tokenizer(s: LmSettings) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(s.model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise HyperparameterError(f"task 'causal-lm': cannot load the tokenizer from "
                                  f"{s.model_dir}: {exc}") from None
    if tok.pad_token is None:
        # Llama/Mistral tokenizers have none; padded positions are masked out of the loss.
        tok.pad_token = tok.eos_token
    if tok.pad_token is None:
        raise HyperparameterError(f"task 'causal-lm': the tokenizer in {s.model_dir} has "
                                  f"neither a pad nor an end-of-sequence token")
    tok.padding_side = "right"
    return tok
