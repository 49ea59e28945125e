"""GPU memory of a LoRA round, estimated before anything is loaded (pure Python, no torch).

Admission needs a figure before the round's process starts, so the agent reads what the base
model's directory already says: the safetensors headers (every tensor's name, dtype and shape:
the exact parameter count, for any architecture, without reading the weights) and config.json
(layers, hidden size, vocabulary). The terms, in bytes:

- base weights: parameters x bytes of the load dtype (4-bit: 0.5 plus ~12% of quantisation
  constants; 8-bit: 1; embeddings and the output head stay in 16 bits when quantised);
- adapters: r x (in + out) per targeted linear layer, float32, times 4 (weights, gradients and
  AdamW's two moments);
- activations kept for backward: 34 x batch x seq x hidden bytes per layer in 16-bit
  activations (Korthikanti et al. 2022, without the seq^2 attention term that SDPA/flash kernels
  do not store), twice that in float32; with gradient checkpointing only each layer's input
  (2 x b x s x h) plus one layer's full set;
- logits: batch x seq x vocab in float32, three copies (logits, softmax, gradient);
- a fixed 600 MiB for the CUDA context and the allocator's fragmentation;

then 20% headroom. It is an estimate for admission, not a promise: the round's real peak is
reported with every update (torch_peak_allocated_mib) and is what to put in a job file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from fedgpu.node.tasks.causal_lm.settings import BaseDtype, LmSettings, Quantization

_MIB = 1 << 20
# A safetensors header is JSON; a real one is a few MB even for a 70B shard.
MAX_HEADER_BYTES = 100 << 20
MAX_SHARDS = 4096
CONTEXT_MIB = 600
HEADROOM = 1.2
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_LOAD_BYTES = {BaseDtype.FLOAT32: 4.0, BaseDtype.BFLOAT16: 2.0, BaseDtype.FLOAT16: 2.0}
# Names of tensors that are not linear layers LoRA would wrap under "all-linear".
_NOT_LINEAR = ("embed", "wte", "wpe", "lm_head", "norm", "ln_", "bias")


class ModelDirError(ValueError):
    """The base model's directory is missing, or is not a Hugging Face model."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs of a base model, read from its directory."""

    parameters: int
    stored_bytes: int
    tensors: tuple[Tensor, ...]
    layers: int
    hidden: int
    vocab: int


@dataclass(frozen=True)
class MemoryEstimate:
    base_mib: int
    adapters_mib: int
    activations_mib: int
    logits_mib: int
    total_mib: int
    lora_parameters: int

    def describe(self) -> str:
        return (f"~{self.total_mib} MiB (base {self.base_mib}, adapters+optimizer "
                f"{self.adapters_mib}, activations {self.activations_mib}, logits "
                f"{self.logits_mib}, context {CONTEXT_MIB}, +{round((HEADROOM - 1) * 100)}%)")


def read_header(path: Path) -> list[Tensor]:
    """The tensors a safetensors file holds, from its header alone."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelDirError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER_BYTES:
                raise ModelDirError(f"{path}: safetensors header of {size} bytes is over "
                                    f"{MAX_HEADER_BYTES}")
            header = json.loads(f.read(size))
    except OSError as exc:
        raise ModelDirError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"{path}: the safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{path}: the safetensors header is not a JSON object")
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            out.append(Tensor(name, str(info["dtype"]), tuple(int(d) for d in info["shape"])))
        except (KeyError, TypeError, ValueError):
            raise ModelDirError(f"{path}: tensor {name!r} has no dtype/shape") from None
    return out


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, sharded (index.json) or single."""
    if not (model_dir / "config.json").is_file():
        raise ModelDirError(f"{model_dir} is not a Hugging Face model directory (no "
                            f"config.json)")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ModelDirError(f"{index} is not a safetensors index: {exc}") from None
        if len(names) > MAX_SHARDS:
            raise ModelDirError(f"{index} names {len(names)} shards, over {MAX_SHARDS}")
        files = [model_dir / n for n in names]
        if any(Path(n).name != n for n in names):
            raise ModelDirError(f"{index} names shards outside the directory")
    else:
        files = [model_dir / "model.safetensors"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelDirError(f"{model_dir} has no {', '.join(missing[:3])}: the base model must "
                            f"be in safetensors format (save_pretrained writes it)")
    return files


def model_facts(model_dir: Path) -> ModelFacts:
    tensors: list[Tensor] = []
    for f in weight_files(model_dir):
        tensors.extend(read_header(f))
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{model_dir / 'config.json'} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{model_dir / 'config.json'} is not a JSON object")
    # Multimodal configs nest the language model's figures.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = _first_int(text, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first_int(text, "hidden_size", "n_embd", "d_model")
    vocab = _first_int(text, "vocab_size")
    return ModelFacts(
        parameters=sum(t.numel for t in tensors),
        stored_bytes=sum(t.numel * _DTYPE_BYTES.get(t.dtype, 4) for t in tensors),
        tensors=tuple(tensors), layers=layers, hidden=hidden, vocab=vocab,
    )


def lora_parameters(facts: ModelFacts, targets: str | tuple[str, ...], r: int) -> int:
    """Parameters LoRA adds: r x (in + out) for each targeted 2-D weight."""
    total = 0
    for t in facts.tensors:
        if len(t.shape) != 2 or not t.name.endswith(".weight"):
            continue
        module = t.name[: -len(".weight")].rsplit(".", 1)[-1]
        if targets == "all-linear":
            if any(k in t.name for k in _NOT_LINEAR):
                continue
        elif module not in targets:
            continue
        total += r * (t.shape[0] + t.shape[1])
    return total


def estimate(facts: ModelFacts, s: LmSettings, batch_size: int, on_gpu_bf16: bool = True
             ) -> MemoryEstimate:
    """The round's GPU memory for `batch_size` sequences of `s.seq_len` tokens."""
    if s.quantization is Quantization.NONE:
        per = _LOAD_BYTES.get(s.dtype, 2.0 if on_gpu_bf16 else 4.0)
        base = facts.parameters * per
    else:
        # Embeddings and the output head are not quantised by bitsandbytes.
        kept = sum(t.numel for t in facts.tensors if len(t.shape) == 2
                   and any(k in t.name for k in ("embed", "wte", "lm_head")))
        per = 0.5 * 1.12 if s.quantization is Quantization.NF4 else 1.0
        base = (facts.parameters - kept) * per + kept * 2
    lora = lora_parameters(facts, s.target_modules, s.lora_r)
    adapters = lora * 4 * 4
    act_bytes = 2 if (s.dtype is not BaseDtype.FLOAT32) else 4
    tokens = batch_size * s.seq_len
    per_layer = 34 * tokens * facts.hidden * act_bytes / 2
    if s.gradient_checkpointing:
        activations = facts.layers * 2 * tokens * facts.hidden * act_bytes / 2 + per_layer
    else:
        activations = facts.layers * per_layer
    logits = 3 * tokens * facts.vocab * 4
    parts = [math.ceil(x / _MIB) for x in (base, adapters, activations, logits)]
    total = math.ceil((sum(parts) + CONTEXT_MIB) * HEADROOM)
    return MemoryEstimate(*parts, total_mib=total, lora_parameters=lora)


def _first_int(config: dict[str, object], *keys: str) -> int:
    for k in keys:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    raise ModelDirError(f"config.json has none of {', '.join(keys)}: cannot size the model")
