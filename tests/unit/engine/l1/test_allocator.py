from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.l1.allocator import AllocatorError, ExtentAllocator
from tests.machine_runs import machine_runs


def test_allocations_are_aligned_and_first_fit() -> None:
    a = ExtentAllocator(64 * 1024, alignment=4096)
    first = a.allocate(1)
    second = a.allocate(5000)
    assert (first, second) == (0, 4096)
    assert a.size_of(second) == 8192
    assert a.used == 12288
    a.check()


def test_free_coalesces_with_both_neighbours() -> None:
    a = ExtentAllocator(16 * 4096, alignment=4096)
    offs = [a.allocate(4096) for _ in range(4)]
    a.free(offs[0])
    a.free(offs[2])
    assert a.free_extents == 3  # [0], [2], and the tail
    a.free(offs[1])  # joins [0] and [2]
    assert a.free_extents == 2
    a.free(offs[3])  # joins everything
    assert a.free_extents == 1
    assert a.largest_free() == a.capacity
    a.check()


def test_exhaustion_returns_none_and_fragmentation_is_visible() -> None:
    a = ExtentAllocator(4 * 4096, alignment=4096)
    offs = [a.allocate(4096) for _ in range(4)]
    assert a.allocate(1) is None
    a.free(offs[0])
    a.free(offs[2])
    assert a.free_bytes == 8192
    assert a.allocate(8192) is None  # two free pages, not contiguous
    assert a.allocate(4096) == 0


def test_double_free_and_bad_sizes_are_errors() -> None:
    a = ExtentAllocator(8192, alignment=4096)
    off = a.allocate(10)
    assert off is not None
    a.free(off)
    with pytest.raises(AllocatorError):
        a.free(off)
    with pytest.raises(AllocatorError):
        a.allocate(0)
    with pytest.raises(ValueError, match="power of two"):
        ExtentAllocator(8192, alignment=3000)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model of which bytes are taken."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ExtentAllocator(64 * 512, alignment=512)
        self.live: dict[int, int] = {}

    @rule(size=st.integers(min_value=1, max_value=9000))
    def allocate(self, size: int) -> None:
        off = self.alloc.allocate(size)
        need = self.alloc.aligned(size)
        if off is None:
            # Refusal only when no free extent is large enough.
            assert self.alloc.largest_free() < need
            return
        assert off % 512 == 0
        for o, n in self.live.items():
            assert off + need <= o or o + n <= off, "overlap"
        self.live[off] = need

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(off)
        del self.live[off]

    @invariant()
    def consistent(self) -> None:
        self.alloc.check()
        assert self.alloc.used == sum(self.live.values())


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = machine_runs(60, 60)
