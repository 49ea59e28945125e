"""Built-in task `causal-lm`: LoRA on a local causal LM, a Dataset task the runner drives.

The runner owns the loop (node/loop.py): DataLoaders over corpus.TextDataset, autocast (`amp =
"bf16"` / `"fp16"` in the job's hyperparameters), the GradScaler for float16, the steps. This
class loads the model (adapters.py), names the data and the optimizer, computes a batch's loss
with the model's own causal-LM loss, and adds perplexity to the evaluation.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedgpu.core.fedstats.columns import ColumnSpec
from fedgpu.node.tasks.base import Datasets, Metrics
from fedgpu.node.tasks.causal_lm import adapters, corpus
from fedgpu.node.tasks.causal_lm.settings import DEFAULTS, TASK_NAME, LmSettings, parse

# Fast tokenizers start a thread pool; forked DataLoader workers would then warn and serialise.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Nothing is fetched at run time: the base model and its tokenizer are on the site.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A loss above this is an untrained model; exp() of it would overflow to inf in the metrics.
_MAX_LOG_PPL = 50.0
# mode = "statistics" tokenises every record it describes: a bound on a site's time.
MAX_STATS_RECORDS = 1_000_000


class CausalLmTask:
    name = TASK_NAME

    def settings(self, hparams: Mapping[str, Any]) -> LmSettings:
        return parse(hparams)

    def build_model(self, hparams: Mapping[str, Any]) -> adapters.AdapterModel:
        return adapters.load(self.settings(hparams))

    def load_datasets(self, data_dir: Path, hparams: Mapping[str, Any]) -> Datasets:
        s = self.settings(hparams)
        train, test = corpus.splits(Path(data_dir), s.eval_fraction)
        tok = adapters.load_tokenizer(s)
        return Datasets(train=corpus.TextDataset(train, tok, s.seq_len, s.text_field),
                        test=corpus.TextDataset(test, tok, s.seq_len, s.text_field))

    def statistics(self, data_dir: Path, hparams: Mapping[str, Any]
                   ) -> list[tuple[ColumnSpec, np.ndarray]]:
        """mode = "statistics": tokens per training record, untruncated, counted by the base
        model's tokenizer (0 to seq_len; longer records fall in the last cell, so it reads as
        "truncated in training"); at most MAX_STATS_RECORDS records, the first in file order."""
        s = self.settings(hparams)
        train, _ = corpus.splits(Path(data_dir), s.eval_fraction)
        texts = corpus.TextDataset(train, adapters.load_tokenizer(s), s.seq_len, s.text_field)
        n = min(len(texts), MAX_STATS_RECORDS)
        lengths = np.array([len(texts.tokenizer(texts.text(i))["input_ids"]) for i in range(n)],
                           dtype=np.float64)
        return [(ColumnSpec("tokens", 0.0, float(s.seq_len), min(s.seq_len, 32)), lengths)]

    def optimizer(self, model: torch.nn.Module, hparams: Mapping[str, Any]
                  ) -> torch.optim.Optimizer:
        s = self.settings(hparams)
        params = (model.trainable_parameters() if isinstance(model, adapters.AdapterModel)
                  else [p for p in model.parameters() if p.requires_grad])
        return torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)

    def batch_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        # Mean over the batch's real (unpadded) next-token predictions.
        return model(**batch).loss

    def warm_up(self, hparams: Mapping[str, Any]) -> None:
        """What the worker factory does once so that every round's worker it forks starts
        warm: import transformers and peft (seconds) and read the tokenizer, but never load the
        base model (gigabytes, and on the CPU) nor touch CUDA."""
        import peft  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401

        own = {k: v for k, v in hparams.items() if k in DEFAULTS}
        try:
            adapters.load_tokenizer(parse(own))
        except ValueError:  # bad hyperparameters: the round reports them
            pass

    def eval_metrics(self, metrics: Metrics) -> Metrics:
        """Perplexity from the held-out loss (mean token cross-entropy, nats)."""
        loss = metrics.get("loss")
        if loss is None or not math.isfinite(loss):
            return {}
        return {"perplexity": math.exp(min(loss, _MAX_LOG_PPL))}
