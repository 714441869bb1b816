"""Page-locked host tensors of exactly their size (``memory.pinned_full``), on a GPU machine."""

from __future__ import annotations

import gc

import pytest
import torch

from oasiskv.memory import pinned_full

# Private names read here: ``memory._page_aligned`` (the page-aligned buffer ``pinned_full``
# registers) probes where the pages landed.

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32])
def test_pinned_full_is_pinned_filled_and_read_by_the_gpu(dtype):
    t = pinned_full((5, 3, 7), 2, dtype)
    assert t.shape == (5, 3, 7) and t.dtype == dtype and t.is_pinned()
    assert (t == 2).all()
    t[1] = 9
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t)
    # The GPU writes into it in place through a mapped copy as well.
    t.copy_(torch.full_like(d, 4), non_blocking=True)
    torch.cuda.synchronize()
    assert (t == 4).all()


def test_a_view_keeps_the_pages_pinned_after_the_tensor_is_gone():
    t = pinned_full((64, 1024), 1.0, torch.float32)
    v = t[3:5]
    ptr = v.data_ptr()
    del t
    gc.collect()
    assert v.is_pinned() and v.data_ptr() == ptr and (v == 1).all()
    d = v.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert (d == 1).all()


def test_many_pools_back_to_back_register_and_release():
    """Unregistered when freed: pinning 64 pools of 16 MiB one after another never accumulates."""
    for i in range(64):
        t = pinned_full((16, 1 << 18), i, torch.float32)
        assert t.is_pinned() and float(t[0, 0]) == i
        del t
        gc.collect()


def test_an_empty_tensor_needs_no_pages():
    t = pinned_full((0, 4), 0, torch.float16)
    assert t.shape == (0, 4)


def test_pinned_full_on_the_gpus_numa_node():
    """Where the machine shows the GPU's NUMA node, the pinned pages are on it (or, where mbind
    is not allowed, wherever the kernel put them: still pinned and filled)."""
    from oasiskv import memory

    node = memory.device_numa_node("cuda")
    if node is None:
        pytest.skip("this machine shows no NUMA node for the GPU")
    t = pinned_full((256, 1024), 3, torch.float32, numa_node=node)
    assert t.is_pinned() and (t == 3).all()
    _, probe = memory._page_aligned(1 << 20)
    if memory.bind_to_numa_node(probe.ctypes.data, probe.nbytes, node):  # mbind allowed here
        assert memory.numa_node_of_page(t.data_ptr()) == node
