"""The peers' way of copying, rebuilt over kvlife's tensors: a list of one copy per block
and layer that moves exactly the bytes kvlife's copy engine moves."""

from __future__ import annotations

import pytest
import torch

from kvlife.offload import CopyEngine, HostPagePool, KVLayout
from kvlife.offload.peer_copies import (
    PeerCopyError,
    batch_copy_available,
    block_copy_list,
    copy_batch,
    copy_per_block,
)

LAYOUT = KVLayout(
    "per_layer", layers=3, slots=64, heads=2, head_dim=4, dtype=torch.float16, page_size=4
)


def _kv() -> list[torch.Tensor]:
    kv = LAYOUT.allocate()
    for i, t in enumerate(kv):
        t.copy_(torch.arange(t.numel()).view(t.shape) + 1000 * i)
    return kv


def _device_pages(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    return [c.view(-1, LAYOUT.page_size, LAYOUT.elems) for c in LAYOUT.component_views(kv)]


def test_the_list_stores_what_kvlife_stores() -> None:
    kv = _kv()
    blocks = torch.tensor([9, 2, 14, 5])
    mine = HostPagePool(LAYOUT, 4, pin_memory=False)
    pages = mine.alloc(4)
    assert pages is not None
    slots = (blocks[:, None] * LAYOUT.page_size + torch.arange(LAYOUT.page_size)).reshape(-1)
    assert CopyEngine(LAYOUT, kv, mine).launch(slots, pages).error is None
    theirs = HostPagePool(LAYOUT, 4, pin_memory=False)
    listed = block_copy_list(
        _device_pages(kv), theirs.tensor, blocks, torch.arange(4), to_host=True
    )
    assert len(listed) == 4 * LAYOUT.components  # one per block and component
    copy_per_block(listed, None)
    assert torch.equal(theirs.tensor, mine.tensor)


def test_the_list_loads_back_into_other_blocks() -> None:
    kv = _kv()
    host = HostPagePool(LAYOUT, 2, pin_memory=False)
    device = _device_pages(kv)
    copy_per_block(
        block_copy_list(device, host.tensor, torch.tensor([1, 3]), torch.arange(2), to_host=True),
        None,
    )
    copy_per_block(
        block_copy_list(
            device, host.tensor, torch.tensor([10, 11]), torch.arange(2), to_host=False
        ),
        None,
    )
    for d in device:
        assert torch.equal(d[10], d[1]) and torch.equal(d[11], d[3])


def test_blocks_that_are_not_contiguous_are_refused() -> None:
    host = HostPagePool(LAYOUT, 2, pin_memory=False)
    strided = [torch.zeros(16, LAYOUT.elems, LAYOUT.page_size).transpose(1, 2)] * 6
    with pytest.raises(ValueError, match="is not 64 contiguous bytes"):
        block_copy_list(strided, host.tensor, torch.tensor([0]), torch.tensor([0]), to_host=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU has no batch copy")
def test_the_batch_copy_needs_cuda() -> None:
    assert not batch_copy_available()
    listed = block_copy_list(
        _device_pages(_kv()),
        HostPagePool(LAYOUT, 1, pin_memory=False).tensor,
        torch.tensor([0]),
        torch.tensor([0]),
        to_host=True,
    )
    with pytest.raises(PeerCopyError, match=r"CUDA 12\.8"):
        copy_batch(listed, None, to_host=True)  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [False, True])
def test_cuda_both_ways_store_and_load_the_same_bytes_as_kvlife(batch: bool) -> None:
    if batch and not batch_copy_available():
        pytest.skip("cudaMemcpyBatchAsync needs CUDA 12.8+")
    kv = [t.cuda() for t in _kv()]
    blocks = torch.tensor([9, 2, 14, 5])
    mine = HostPagePool(LAYOUT, 4, pin_memory=True)
    pages = mine.alloc(4)
    assert pages is not None
    slots = (blocks[:, None] * LAYOUT.page_size + torch.arange(LAYOUT.page_size)).reshape(-1)
    job = CopyEngine(LAYOUT, kv, mine).launch(slots, pages)
    theirs = HostPagePool(LAYOUT, 4, pin_memory=True)
    device = _device_pages(kv)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out = block_copy_list(device, theirs.tensor, blocks, torch.arange(4), to_host=True)
    back = block_copy_list(
        device, theirs.tensor, torch.tensor([10, 11, 12, 13]), torch.arange(4), to_host=False
    )
    for listed, to_host in ((out, True), (back, False)):
        if batch:
            copy_batch(listed, stream, to_host=to_host)
        else:
            copy_per_block(listed, stream)
    torch.cuda.synchronize()
    assert job.query() and torch.equal(theirs.tensor, mine.tensor)
    for d in device:
        assert torch.equal(d[torch.tensor([10, 11, 12, 13], device="cuda")], d[blocks.cuda()])


def test_blocks_or_pages_out_of_range_are_refused() -> None:
    host = HostPagePool(LAYOUT, 2, pin_memory=False)
    device = _device_pages(_kv())
    with pytest.raises(ValueError, match="block ids out of range"):
        block_copy_list(device, host.tensor, torch.tensor([16]), torch.tensor([0]), to_host=True)
    with pytest.raises(ValueError, match="host pages out of range"):
        block_copy_list(device, host.tensor, torch.tensor([0]), torch.tensor([2]), to_host=True)
