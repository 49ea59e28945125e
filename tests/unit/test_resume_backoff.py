"""The pause before a gRPC transfer resumes (node/resume_backoff.py): at once after a stream
that moved bytes (the cost a cut adds over a WAN), a bounded backoff after resumes that moved
nothing, so a node never spins against a down aggregator (the threat: a fleet of nodes
reconnecting in a tight loop to an aggregator that is restarting)."""

from __future__ import annotations

from fedgpu.node.resume_backoff import MAX_PAUSE_S, PAUSE_S, Progress, resume_pause
from fedgpu.node.wire_client import GRPC_RESUMES


def test_the_first_resume_after_a_stream_that_moved_bytes_is_immediate() -> None:
    progress = Progress()
    assert progress.pause_after(1 << 20) == 0.0
    # Broken again after more bytes: still a stream that moved some.
    assert progress.pause_after(3 << 20) == 0.0


def test_resumes_that_move_nothing_back_off_to_a_bound() -> None:
    progress = Progress()
    assert progress.pause_after(1 << 20) == 0.0
    pauses = [progress.pause_after(1 << 20) for _ in range(6)]
    assert pauses == [PAUSE_S, 2 * PAUSE_S] + [MAX_PAUSE_S] * 4
    assert all(0 < p <= MAX_PAUSE_S for p in pauses)
    # Progress again resets the backoff.
    assert progress.pause_after(2 << 20) == 0.0
    assert progress.pause_after(2 << 20) == PAUSE_S


def test_a_break_before_any_byte_is_not_resumed_at_once() -> None:
    assert Progress().pause_after(0) == PAUSE_S
    assert resume_pause(0) == 0.0 and resume_pause(-1) == 0.0


def test_all_resumes_failing_wait_a_bounded_time() -> None:
    """A stopped node's transfer thread must end within core/lifetime.py's bound: the resumes
    of one transfer that all fail wait at most a few seconds together."""
    progress = Progress()
    total = progress.pause_after(1) + sum(progress.pause_after(1)
                                          for _ in range(GRPC_RESUMES - 1))
    assert 0 < total <= 4.0
