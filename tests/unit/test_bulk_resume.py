"""When the node's bulk client resumes a transfer on its ticket, how long it waits first, and
when it gives up (node/bulk_client.py, node/resume_backoff.py). The attempts are plain
callables: what is decided here is the rule (tests/integration/test_bulk_resume_pace.py runs
it against a real aggregator). Threat model: a node must never reconnect in a tight loop to an
aggregator that is down or refusing (a fleet doing so would flood it as it restarts), and a
stopped node's transfer must end within core/lifetime.py's STOP_LIMIT_S."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fedgpu.core import bulk
from fedgpu.core.lifetime import STOP_LIMIT_S
from fedgpu.node.bulk_client import RESUMES, BulkPath
from fedgpu.node.resume_backoff import MAX_PAUSE_S, PAUSE_S


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
    assert path._resuming(attempt, lambda: 1, sleep=lambda s: None) == "done"
    assert path.resumed == 2 and path.error is None


def test_an_unreachable_port_at_the_first_attempt_is_not_resumed() -> None:
    path = _path()
    with pytest.raises(bulk.BulkUnreachable):
        path._resuming(_script(bulk.BulkUnreachable("refused")), lambda: 1,
                       sleep=lambda s: None)
    assert path.resumed == 0


def test_nothing_to_resume_from_is_handed_back_at_once() -> None:
    path = _path()
    with pytest.raises(ConnectionResetError):
        path._resuming(_script(ConnectionResetError("reset")), lambda: 0,
                       sleep=lambda s: None)
    assert path.resumed == 0


def test_resumes_are_bounded() -> None:
    path = _path()
    breaks = [ConnectionResetError(f"reset {i}") for i in range(RESUMES + 1)]
    with pytest.raises(ConnectionError, match=f"broke off {RESUMES + 1} times"):
        path._resuming(_script(*breaks), lambda: 1, sleep=lambda s: None)
    assert path.resumed == RESUMES


def _moving(*outcomes: tuple[int, BaseException | str]) -> tuple[Callable[[], str],
                                                                   Callable[[], int]]:
    """Attempts that each move some bytes (the first of each pair) before their outcome, and
    the bytes reached so far."""
    left, reached = list(outcomes), [0]

    def attempt() -> str:
        moved, out = left.pop(0)
        reached[0] += moved
        if isinstance(out, BaseException):
            raise out
        return out

    return attempt, lambda: reached[0]


def test_a_resume_after_a_connection_that_moved_bytes_goes_at_once() -> None:
    path, pauses = _path(), []
    attempt, reached = _moving((1 << 20, ConnectionResetError("cut")),
                               (2 << 20, ConnectionResetError("cut again")), (3 << 20, "done"))
    assert path._resuming(attempt, reached, sleep=pauses.append) == "done"
    assert pauses == [0.0, 0.0] and path.resumed == 2


def test_resumes_that_move_nothing_back_off_and_progress_resets_it() -> None:
    path, pauses = _path(), []
    attempt, reached = _moving((1 << 20, ConnectionResetError("cut")),
                               (0, bulk.BulkUnreachable("aggregator restarting")),
                               (0, ConnectionResetError("reset at the door")),
                               (1 << 20, ConnectionResetError("cut")), (1 << 20, "done"))
    assert path._resuming(attempt, reached, sleep=pauses.append) == "done"
    assert pauses == [0.0, PAUSE_S, 2 * PAUSE_S, 0.0]


def test_an_upload_resumes_even_when_nothing_was_handed_over() -> None:
    """An upload's aggregator may hold bytes from an earlier connection (its go-ahead names
    them): a break is resumed after a pause even when this node handed over nothing."""
    path, pauses = _path(), []
    attempt, reached = _moving((0, ConnectionResetError("reset")), (0, "done"))
    assert path._resuming(attempt, reached, sleep=pauses.append, always=True) == "done"
    assert pauses == [PAUSE_S]


def test_resumes_against_a_down_aggregator_wait_a_bounded_time() -> None:
    path, pauses = _path(), []
    attempt, reached = _moving((1 << 20, ConnectionResetError("cut")),
                               *[(0, bulk.BulkUnreachable("down"))] * RESUMES)
    with pytest.raises(ConnectionError, match=f"broke off {RESUMES + 1} times"):
        path._resuming(attempt, reached, sleep=pauses.append)
    # Never a tight loop (every resume after the first waits), never past the stop limit.
    assert pauses[0] == 0.0 and all(PAUSE_S <= p <= MAX_PAUSE_S for p in pauses[1:])
    assert len(pauses) == RESUMES and sum(pauses) < STOP_LIMIT_S / 2
