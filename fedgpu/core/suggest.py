"""'Did you mean' for names people type: job-file keys, strategies, tasks, profiles."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def nearest(word: str, known: Iterable[str]) -> str | None:
    """The known name closest to `word`, if any is close enough to be a typo of it."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """' (did you mean 'rounds'?)' for a near miss, '' otherwise: appended to an error."""
    close = nearest(word, known)
    return f" (did you mean {close!r}?)" if close else ""
