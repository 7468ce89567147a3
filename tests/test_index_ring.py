"""IndexRing: indices reach the device through memory made once, reused only after the
copy that read them is done, in order; a full ring falls back and says so."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlife.offload.index_ring import IndexRing


class Flag:
    """A stand-in for a CUDA event: done when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _ring(capacity: int) -> IndexRing:
    return IndexRing(capacity, torch.device("cpu"), pin=False)


def _put(ring: IndexRing, values: list[int]) -> torch.Tensor:
    return ring.put(torch.tensor(values, dtype=torch.long), None)


def test_put_returns_the_values_in_the_device_buffer() -> None:
    ring = _ring(8)
    out = _put(ring, [5, 6, 7])
    assert out.tolist() == [5, 6, 7]
    assert out.data_ptr() == ring.device_buffer.data_ptr()  # a view, nothing allocated
    assert ring.in_use == 3 and ring.overflows == 0


def test_a_stretch_is_not_reused_before_its_copy_is_done() -> None:
    ring = _ring(8)
    first = _put(ring, [1, 2, 3, 4, 5])
    done = Flag()
    ring.seal(done)
    second = _put(ring, [9, 9, 9])  # the rest of the ring
    ring.seal(Flag())
    third = _put(ring, [7])  # no room: falls back, the first stretch is untouched
    assert ring.overflows == 1 and third.tolist() == [7]
    assert first.tolist() == [1, 2, 3, 4, 5] and second.tolist() == [9, 9, 9]
    done.done = True
    reused = _put(ring, [8, 8])  # wraps into the first stretch, now free
    assert ring.overflows == 1 and reused.data_ptr() == ring.device_buffer.data_ptr()


def test_an_unsealed_stretch_is_never_reused() -> None:
    ring = _ring(4)
    _put(ring, [1, 2, 3, 4])
    assert _put(ring, [5]).tolist() == [5] and ring.overflows == 1


def test_stretches_are_freed_in_order() -> None:
    ring = _ring(6)
    _put(ring, [1, 1])
    first = Flag()
    ring.seal(first)
    _put(ring, [2, 2])
    second = Flag()
    ring.seal(second)
    second.done = True  # done out of order: the first still holds its place
    assert ring.in_use == 4
    _put(ring, [3, 3])
    ring.seal(Flag())
    assert ring.in_use == 6
    first.done = True
    _put(ring, [4])
    assert ring.in_use == 3  # both freed, [3, 3] still held, then [4]


def test_abandon_gives_back_the_unsealed_stretches() -> None:
    ring = _ring(8)
    _put(ring, [1, 2])
    ring.seal(Flag())
    _put(ring, [3, 4, 5])
    _put(ring, [6])
    ring.abandon()
    assert ring.in_use == 2
    assert _put(ring, [7, 7, 7, 7, 7, 7]).data_ptr() == ring.device_buffer[2:].data_ptr()


def test_a_stretch_longer_than_the_ring_falls_back() -> None:
    ring = _ring(4)
    assert _put(ring, list(range(10))).tolist() == list(range(10))
    assert ring.overflows == 1 and ring.in_use == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity must be positive"):
        _ring(0)


@given(
    st.lists(
        st.tuples(st.integers(1, 7), st.integers(0, 3)),  # (length, how many become done)
        min_size=1,
        max_size=60,
    )
)
def test_live_stretches_never_overlap_and_keep_their_values(
    steps: list[tuple[int, int]],
) -> None:
    ring = _ring(16)
    live: list[tuple[Flag, torch.Tensor, list[int]]] = []
    for serial, (length, finish) in enumerate(steps):
        for flag, _, _ in live[:finish]:
            flag.done = True
        values = [serial * 10 + i for i in range(length)]
        out = _put(ring, values)
        flag = Flag()
        ring.seal(flag)
        live.append((flag, out, values))
        for flag_, out_, values_ in live:  # what a copy not yet done reads is intact
            if not flag_.done:
                assert out_.tolist() == values_
        live = [entry for entry in live if not entry[0].done]
