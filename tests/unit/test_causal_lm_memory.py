"""The causal-lm GPU memory estimate and the site's admission of the task (pure Python)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from fedgpu.core.constants import GpuNeed
from fedgpu.core.job.resources import Resources
from fedgpu.node import task_needs
from fedgpu.node.policy import Ineligible
from fedgpu.node.tasks.base import HyperparameterError
from fedgpu.node.tasks.causal_lm import memory, settings
from fedgpu.node.tasks.causal_lm.site import SiteRefusal, for_site

# A Llama-7B-shaped model: 32 layers, hidden 4096, MLP 11008, vocab 32000, bf16.
H, FF, V, L = 4096, 11008, 32000, 32


def _write_safetensors_header(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    # Only the header: the estimate never reads the weights, so the data section is absent.
    header = {name: {"dtype": d, "shape": s, "data_offsets": [0, 0]}
              for name, (d, s) in tensors.items()}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def _llama_dir(root: Path, sharded: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(
        {"num_hidden_layers": L, "hidden_size": H, "vocab_size": V}))
    tensors = {"model.embed_tokens.weight": ("BF16", [V, H]),
               "lm_head.weight": ("BF16", [V, H]), "model.norm.weight": ("BF16", [H])}
    for i in range(L):
        p = f"model.layers.{i}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}self_attn.{m}.weight"] = ("BF16", [H, H])
        tensors[f"{p}mlp.gate_proj.weight"] = ("BF16", [FF, H])
        tensors[f"{p}mlp.up_proj.weight"] = ("BF16", [FF, H])
        tensors[f"{p}mlp.down_proj.weight"] = ("BF16", [H, FF])
        tensors[f"{p}input_layernorm.weight"] = ("BF16", [H])
    if not sharded:
        _write_safetensors_header(root / "model.safetensors", tensors)
        return root
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in halves.items():
        _write_safetensors_header(root / fname, {n: tensors[n] for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in halves.items() for n in part}}))
    return root


def _settings(**hp: object) -> settings.LmSettings:
    return settings.parse({"model_dir": "/m", **hp})


@pytest.mark.parametrize("sharded", [False, True])
def test_facts_count_every_parameter_from_the_headers(tmp_path: Path, sharded: bool) -> None:
    facts = memory.model_facts(_llama_dir(tmp_path / "m", sharded))
    expected = 2 * V * H + H + L * (4 * H * H + 3 * H * FF + H)
    assert facts.parameters == expected  # 6.74e9: Llama-2-7B's count
    assert facts.stored_bytes == 2 * expected
    assert (facts.layers, facts.hidden, facts.vocab) == (L, H, V)


def test_lora_size_is_r_times_in_plus_out_of_the_targeted_layers(tmp_path: Path) -> None:
    facts = memory.model_facts(_llama_dir(tmp_path / "m"))
    assert memory.lora_parameters(facts, ("q_proj", "v_proj"), 16) == L * 2 * 16 * (H + H)
    # all-linear: the 7 projections of each layer, not the embeddings, the head or the norms.
    all_linear = L * 16 * (4 * (H + H) + 3 * (H + FF))
    assert memory.lora_parameters(facts, "all-linear", 16) == all_linear


def test_estimate_moves_with_dtype_quantisation_batch_and_checkpointing(tmp_path: Path) -> None:
    facts = memory.model_facts(_llama_dir(tmp_path / "m"))
    bf16 = memory.estimate(facts, _settings(dtype="bfloat16", seq_len=512), batch_size=4)
    # 6.74e9 parameters in bf16 are 12.6 GiB of weights.
    assert 12_800 <= bf16.base_mib <= 12_900
    fp32 = memory.estimate(facts, _settings(dtype="float32", seq_len=512), batch_size=4)
    nf4 = memory.estimate(facts, _settings(quantization="4bit", seq_len=512), batch_size=4)
    assert fp32.base_mib == pytest.approx(2 * bf16.base_mib, abs=1)
    assert nf4.base_mib < bf16.base_mib / 3
    big_batch = memory.estimate(facts, _settings(dtype="bfloat16", seq_len=512), batch_size=16)
    assert big_batch.activations_mib == 4 * bf16.activations_mib
    ckpt = memory.estimate(facts, _settings(dtype="bfloat16", seq_len=512,
                                             gradient_checkpointing=True), batch_size=16)
    assert ckpt.activations_mib < big_batch.activations_mib / 5
    # Every term, the context and the headroom are in the total.
    parts = bf16.base_mib + bf16.adapters_mib + bf16.activations_mib + bf16.logits_mib
    assert bf16.total_mib == pytest.approx((parts + memory.CONTEXT_MIB) * memory.HEADROOM, abs=1)
    assert "MiB" in bf16.describe()


def test_a_directory_without_weights_or_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(memory.ModelDirError, match="no config.json"):
        memory.model_facts(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(memory.ModelDirError, match="safetensors format"):
        memory.model_facts(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(memory.ModelDirError, match="header of"):
        memory.model_facts(tmp_path)


def test_settings_refuse_typos_and_impossible_values() -> None:
    with pytest.raises(HyperparameterError, match="model_dir is required"):
        settings.parse({})
    with pytest.raises(HyperparameterError, match="no hyperparameter.*lora_rank"):
        settings.parse({"model_dir": "/m", "lora_rank": 8})
    with pytest.raises(HyperparameterError, match="quantization must be one of"):
        settings.parse({"model_dir": "/m", "quantization": "2bit"})
    with pytest.raises(HyperparameterError, match="target_modules"):
        settings.parse({"model_dir": "/m", "target_modules": "all-linear,q_proj"})
    s = settings.parse({"model_dir": "/m", "target_modules": "q_proj, v_proj"})
    assert s.target_modules == ("q_proj", "v_proj")


def test_site_without_the_model_is_ineligible_with_the_path(tmp_path: Path) -> None:
    need = Resources(gpu=GpuNeed.PREFERRED)
    with pytest.raises(SiteRefusal, match=r"base model directory .*nowhere.* not on this site"):
        for_site({"model_dir": "nowhere"}, tmp_path, need)
    # Through the agent's hook, the same refusal is an Ineligible answer.
    with pytest.raises(Ineligible, match="not on this site"):
        task_needs.for_site("causal-lm", json.dumps({"model_dir": "nowhere"}), tmp_path, need)
    # Other tasks and bundles are not the hook's business.
    assert task_needs.for_site("digits", "{}", tmp_path, need) == (need, "{}")


def test_site_resolves_a_relative_dir_and_derives_gpu_memory(tmp_path: Path) -> None:
    _llama_dir(tmp_path / "models" / "llama")
    data = tmp_path / "node-1"
    data.mkdir()
    hp = {"model_dir": "../models/llama", "batch_size": 4, "seq_len": 512}
    need, site_hp = for_site(hp, data, Resources(gpu=GpuNeed.PREFERRED))
    assert site_hp["model_dir"] == str((tmp_path / "models" / "llama").resolve())
    s = settings.parse({k: v for k, v in site_hp.items() if k != "batch_size"})
    est = memory.estimate(memory.model_facts(Path(site_hp["model_dir"])), s, 4)
    assert need.gpu_memory_mib == need.min_gpu_free_mib == est.total_mib
    # A figure the job gives wins; a job without a GPU needs no figure.
    given = Resources(gpu=GpuNeed.REQUIRED, gpu_memory_mib=20_000)
    assert for_site(hp, data, given)[0] == given
    none = Resources(gpu=GpuNeed.NONE)
    assert for_site(hp, data, none)[0] == none


def test_quantisation_needs_bitsandbytes_and_a_gpu(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _llama_dir(tmp_path / "m")
    hp = {"model_dir": str(tmp_path / "m"), "quantization": "4bit"}
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(SiteRefusal, match="bitsandbytes, which this site has not installed"):
        for_site(hp, tmp_path, Resources(gpu=GpuNeed.PREFERRED))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(SiteRefusal, match="needs a CUDA GPU"):
        for_site(hp, tmp_path, Resources(gpu=GpuNeed.NONE))
    # With it, a "preferred" GPU becomes required: 4-bit kernels have no CPU fallback.
    need, _ = for_site(hp, tmp_path, Resources(gpu=GpuNeed.PREFERRED))
    assert need.gpu is GpuNeed.REQUIRED and need.gpu_memory_mib is not None


def test_the_reference_page_names_every_hyperparameter() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "causal-lm-task.md"
            ).read_text()
    missing = [k for k in settings.DEFAULTS if f"| `{k}` |" not in page]
    assert not missing, f"docs/reference/causal-lm-task.md lacks {missing}"
