"""User-facing errors: the CLI prints their message as one line and exits non-zero."""

from __future__ import annotations


class FedgpuError(Exception):
    """An error whose message already says what was wrong and what to do."""

    exit_code = 1


class ConfigError(FedgpuError):
    exit_code = 2
