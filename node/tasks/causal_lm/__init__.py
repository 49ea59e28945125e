"""Built-in task `causal-lm`: LoRA fine-tuning of a local Hugging Face causal language model.

Only the adapters travel: the global model of a `causal-lm` job is the LoRA tensor set (see
adapters.py), the base model is read from a directory on each site and never leaves it.

This package's `__init__` imports nothing heavy: the agent reads `settings` and `site` (pure
Python) to answer admission without importing torch or transformers; `task` holds the task.
"""
