"""Token-slot lifecycle: legal transitions, errors for illegal ones, all-or-nothing take."""

import pytest

from specloop.scheduling.token_slots import SlotState, TokenSlotPool


def test_lifecycle_finish_and_retire():
    pool = TokenSlotPool(4)
    a = pool.take(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    assert {pool.state(s) for s in a} == {SlotState.SOURCE_READY}
    pool.finish([0])
    pool.retire([1, 2])
    assert (pool.state(0), pool.state(1)) == (SlotState.REUSABLE, SlotState.RETIRED)
    assert pool.num_free == 1  # not reusable before release
    pool.release([0, 1, 2])
    assert pool.num_free == 4 and all(pool.state(s) is SlotState.EMPTY for s in range(4))
    assert pool.take(4) == [3, 0, 1, 2]  # FIFO reuse


def test_take_is_all_or_nothing():
    pool = TokenSlotPool(2)
    assert pool.take(3) is None and pool.num_free == 2
    assert pool.take(2) == [0, 1]
    assert pool.take(1) is None


@pytest.mark.parametrize("bad", [
    lambda p, s: p.release(s),            # release a live slot (use after free later)
    lambda p, s: p.finish(s + s),         # the same slot twice
    lambda p, s: (p.finish(s), p.finish(s)),
    lambda p, s: (p.retire(s), p.finish(s)),
    lambda p, s: (p.finish(s), p.release(s), p.release(s)),  # double free
    lambda p, s: p.finish([3]),           # never taken
])
def test_illegal_transitions_raise(bad):
    pool = TokenSlotPool(4)
    slots = pool.take(1)
    with pytest.raises(ValueError, match="token slot"):
        bad(pool, slots)
