"""One logging format for every fedgpu process; logs go to stderr, data to stdout."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup(level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT, stream=sys.stderr, force=True)
