"""Host slots (node/rounds/slots.py): CPU slots and GPU shares, FIFO per resource."""

from __future__ import annotations

import pytest

from fedgpu.node.rounds.slots import Need, Slots, default_cpu_slots

CPU = Need()


def gpu(uuid: str = "GPU-a", share: float | None = None) -> Need:
    return Need("cuda", uuid, share)


def test_cpu_rounds_beyond_the_slots_wait_in_order() -> None:
    s: Slots[str] = Slots(2)
    for name in "abcd":
        s.submit(name, CPU)
    assert s.ready() == ["a", "b"]
    assert s.ready() == []
    assert (s.running(), s.queued()) == (2, 2)
    s.release("b")
    assert s.ready() == ["c"]
    s.release("a")
    s.release("c")
    assert s.ready() == ["d"]
    assert s.position("d") == -1


def test_gpu_shares_fill_a_card_exactly_and_cards_are_counted_apart() -> None:
    s: Slots[str] = Slots(1)
    for name in ("a1", "a2", "a3", "a4"):
        s.submit(name, gpu(share=0.3))
    s.submit("b1", gpu("GPU-b"))  # no cap: the whole card
    s.submit("b2", gpu("GPU-b", 0.1))
    assert s.ready() == ["a1", "a2", "a3", "b1"]
    s.release("b1")
    assert s.ready() == ["b2"]
    s.release("a1")
    assert s.ready() == ["a4"]
    # 0.3 + 0.3 + 0.4: thousandths, so three shares that add up to one card fit.
    t: Slots[str] = Slots(1)
    for name, share in (("x", 0.3), ("y", 0.3), ("z", 0.4)):
        t.submit(name, gpu(share=share))
    assert t.ready() == ["x", "y", "z"]


def test_a_gpu_round_takes_no_cpu_slot_and_a_full_gpu_does_not_block_the_cpu() -> None:
    s: Slots[str] = Slots(1)
    s.submit("g1", gpu())
    s.submit("g2", gpu())
    s.submit("c1", CPU)
    assert s.ready() == ["g1", "c1"]
    assert s.position("g2") == 0


def test_a_large_share_is_not_overtaken_by_smaller_ones_behind_it() -> None:
    s: Slots[str] = Slots(1)
    s.submit("small", gpu(share=0.5))
    s.submit("whole", gpu())
    s.submit("late", gpu(share=0.2))
    assert s.ready() == ["small"]
    # 0.2 would fit next to 0.5, but "whole" asked first.
    assert s.ready() == []
    s.release("small")
    assert s.ready() == ["whole"]


def test_a_queued_request_can_be_given_up_and_nothing_is_counted_twice() -> None:
    s: Slots[str] = Slots(1)
    s.submit("a", CPU)
    s.submit("b", CPU)
    assert s.ready() == ["a"]
    s.release("b")  # gave up while waiting
    assert s.queued() == 0
    with pytest.raises(ValueError, match="already"):
        s.submit("a", CPU)
    s.release("a")
    s.submit("c", CPU)
    assert s.ready() == ["c"]


def test_bad_slot_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Slots(0)
    assert default_cpu_slots() >= 1
