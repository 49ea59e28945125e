"""`fedgpu data synth-lm`: a tiny causal LM and a learnable corpus, for tests and the tutorial.

Writes, with nothing downloaded:

    OUT/model/             a randomly initialised Llama (2 layers, hidden 64 by default) in
                           Hugging Face format, with a word-level tokenizer built locally by
                           the `tokenizers` package (words w0 .. w{V-1} plus 4 specials)
    OUT/node-K/train.jsonl one {"text": ...} object a line, per node
    OUT/node-K/test.jsonl  each node's held-out records

The corpus is a noisy walk: after word w_i comes w_((5i + 3) mod V) with probability 0.9, any
word otherwise. A model that learns the rule reaches a loss near the walk's entropy (~0.7 nats
for V = 48), an untrained one sits near ln V, so falling perplexity is a real signal. The output
head is drawn with a larger spread than the Llama default (std 0.15, not 0.02): behind a frozen
RMSNorm a head that small caps every logit near 1, and LoRA could not learn anything sharp.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.core.datasets import NODE_DIR_PREFIX
from fedgpu.core.errors import ConfigError

SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
MODEL_DIR = "model"
MAX_NODES = 1000
MAX_RECORDS = 1_000_000


@dataclass(frozen=True)
class SynthLm:
    """What to write: corpus and model sizes."""

    nodes: int = 3
    records: int = 400  # training records per node
    test_records: int = 64  # held-out records per node
    words: int = 32  # per record
    vocab: int = 48
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    seed: int = 0
    noise: float = 0.1


def next_word(i: int, vocab: int) -> int:
    return (5 * i + 3) % vocab


def record(rng: random.Random, s: SynthLm) -> str:
    w = rng.randrange(s.vocab)
    out = [w]
    for _ in range(s.words - 1):
        w = next_word(w, s.vocab) if rng.random() >= s.noise else rng.randrange(s.vocab)
        out.append(w)
    return " ".join(f"w{x}" for x in out)


def synth_lm(out: Path, s: SynthLm, force: bool = False) -> tuple[Path, list[Path]]:
    """Write the model and the node directories; returns (model dir, node dirs)."""
    if not 1 <= s.nodes <= MAX_NODES:
        raise ValueError(f"--nodes must be from 1 to {MAX_NODES}, got {s.nodes}")
    if not (1 <= s.records <= MAX_RECORDS and 1 <= s.test_records <= MAX_RECORDS):
        raise ValueError(f"--records and --test-records must be from 1 to {MAX_RECORDS}")
    if not 2 <= s.vocab <= 100_000 or s.vocab % 5 == 0:
        # 5i + 3 mod V walks every word only when 5 and V share no factor.
        raise ValueError(f"--vocab must be from 2 to 100000 and not a multiple of 5 "
                         f"(got {s.vocab})")
    if s.hidden % s.heads or s.hidden < s.heads or s.layers < 1 or s.words < 2:
        raise ValueError("--hidden must be a multiple of --heads, --layers >= 1, --words >= 2")
    out = Path(out)
    model_dir = out / MODEL_DIR
    node_dirs = [out / f"{NODE_DIR_PREFIX}{k}" for k in range(1, s.nodes + 1)]
    existing = [p for p in (model_dir, *node_dirs) if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists: pass --force to replace it")
    for p in existing:
        shutil.rmtree(p)
    _write_model(model_dir, s)
    rng = random.Random(s.seed)
    for d in node_dirs:
        d.mkdir(parents=True)
        for name, n in (("train.jsonl", s.records), ("test.jsonl", s.test_records)):
            lines = (json.dumps({"text": record(rng, s)}) for _ in range(n))
            (d / name).write_text("\n".join(lines) + "\n")
    return model_dir, node_dirs


def _write_model(model_dir: Path, s: SynthLm) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    vocab = {t: i for i, t in enumerate([*SPECIALS, *(f"w{i}" for i in range(s.vocab))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=s.hidden, intermediate_size=2 * s.hidden,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
        max_position_embeddings=max(512, 2 * s.words), pad_token_id=0, bos_token_id=2,
        eos_token_id=3, tie_word_embeddings=False,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(s.seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 0.15)
    model_dir.mkdir(parents=True)
    model.save_pretrained(model_dir)
    fast.save_pretrained(model_dir)


def synth_lm_cmd(
    out: Annotated[Path, typer.Option(
        "--out", help="Directory to write model/ and node-1 .. node-N into.")],
    nodes: Annotated[int, typer.Option("--nodes", help="Number of node directories.")] = 3,
    records: Annotated[int, typer.Option(
        "--records", help="Training records (lines) per node.")] = SynthLm.records,
    test_records: Annotated[int, typer.Option(
        "--test-records", help="Held-out records per node.")] = SynthLm.test_records,
    vocab: Annotated[int, typer.Option(
        "--vocab", help="Words in the vocabulary (not a multiple of 5).")] = SynthLm.vocab,
    hidden: Annotated[int, typer.Option("--hidden", help="Model width.")] = SynthLm.hidden,
    layers: Annotated[int, typer.Option("--layers", help="Transformer layers.")
                      ] = SynthLm.layers,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the model and the corpus.")] = 0,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace model/ and the node-K directories of an earlier run.")] = False,
) -> None:
    """A tiny random causal LM (Hugging Face format) and a learnable text corpus per node.

    Example: fedgpu data synth-lm --out lm-data --nodes 3
    """
    spec = SynthLm(nodes=nodes, records=records, test_records=test_records, vocab=vocab,
                   hidden=hidden, layers=layers, seed=seed)
    try:
        model_dir, dirs = synth_lm(out, spec, force=force)
    except ImportError as exc:
        raise ConfigError(f"synth-lm needs transformers: pip install 'fedgpu[lm]' ({exc})"
                          ) from None
    except (ValueError, FileExistsError) as exc:
        raise ConfigError(str(exc)) from None
    print(f"model: {model_dir}", file=sys.stderr)
    for d in dirs:
        print(d)
