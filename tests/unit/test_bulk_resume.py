"""When the node's bulk client resumes a transfer on its ticket, and when it gives up
(node/bulk_client.py). The attempts are plain callables: what is decided here is the rule."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fedgpu.core import bulk
from fedgpu.node.bulk_client import RESUMES, BulkPath


def _path() -> BulkPath:
    path = BulkPath("127.0.0.1:1", None)
    path.reset(2)
    return path


def _script(*outcomes: BaseException | str) -> Callable[[], str]:
    left = list(outcomes)

    def attempt() -> str:
        out = left.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    return attempt


def test_a_break_after_progress_is_resumed_even_while_the_port_is_briefly_gone() -> None:
    path = _path()
    attempt = _script(ConnectionResetError("reset"), bulk.BulkUnreachable("refused"), "done")
    assert path._resuming(attempt, lambda: True, sleep=lambda s: None) == "done"
    assert path.resumed == 2 and path.error is None


def test_an_unreachable_port_at_the_first_attempt_is_not_resumed() -> None:
    path = _path()
    with pytest.raises(bulk.BulkUnreachable):
        path._resuming(_script(bulk.BulkUnreachable("refused")), lambda: True,
                       sleep=lambda s: None)
    assert path.resumed == 0


def test_nothing_to_resume_from_is_handed_back_at_once() -> None:
    path = _path()
    with pytest.raises(ConnectionResetError):
        path._resuming(_script(ConnectionResetError("reset")), lambda: False,
                       sleep=lambda s: None)
    assert path.resumed == 0


def test_resumes_are_bounded() -> None:
    path = _path()
    breaks = [ConnectionResetError(f"reset {i}") for i in range(RESUMES + 1)]
    with pytest.raises(ConnectionError, match=f"broke off {RESUMES + 1} times"):
        path._resuming(_script(*breaks), lambda: True, sleep=lambda s: None)
    assert path.resumed == RESUMES
