"""NUMA placement of the pinned KV host pool (issue 14), on the CPU: the GPU's node from a fake
sysfs tree, the fallbacks (no node shown, a failing ``mbind``), a real ``mbind`` where the kernel
allows it, and ``pinned_full`` with a stand-in for ``cudaHostRegister`` (no CUDA is called)."""

from __future__ import annotations

import gc
import logging
import platform
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oasiskv import memory
from oasiskv.memory import (
    bind_to_numa_node,
    device_numa_node,
    normalize_bus_id,
    numa_node_of_page,
    pci_numa_node,
)

# Private names read here: ``memory._page_aligned``, ``_PAGE``, ``_SYSCALLS``, ``_NODE_MASK_BITS``,
# ``_libc`` (replaced by a stand-in ``mbind``) and ``_numa_warned`` (the warn-once flag): the
# placement internals are what this file checks, on machines without a GPU.

#: sysfs directory name -> the text of its ``numa_node`` file (None: no such file).
SYSFS = {
    "0000:3b:00.0": "1\n",
    "0000:86:00.0": "-1\n",
    "0000:d8:00.0": "garbage\n",
    "0001:1a:00.0": "3\n",
    "0000:5e:00.0": None,
}


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    for name, text in SYSFS.items():
        (tmp_path / name).mkdir()
        if text is not None:
            (tmp_path / name / "numa_node").write_text(text)
    return tmp_path


@pytest.fixture(autouse=True)
def warn_again(monkeypatch):
    """Every test starts as a fresh process would: no NUMA warning given yet."""
    monkeypatch.setattr(memory, "_numa_warned", False)


def test_bus_ids_are_normalized_as_sysfs_names_them():
    assert normalize_bus_id("0000:3B:00.0") == "0000:3b:00.0"  # cudaDeviceGetPCIBusId
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"  # NVML
    assert normalize_bus_id(" 3b:0.1 ") == "0000:3b:00.1"
    for bad in ("", "3b", "0000:3b:00", "zz:00.0", "0000:3b:00.9"):
        with pytest.raises(ValueError, match="not a PCI bus id"):
            normalize_bus_id(bad)


def test_pci_numa_node_reads_the_node_or_says_none(sysfs):
    assert pci_numa_node("0000:3B:00.0", sysfs) == 1
    assert pci_numa_node("00000001:1A:00.0", sysfs) == 3
    assert pci_numa_node("0000:86:00.0", sysfs) is None  # -1: the machine shows no node
    assert pci_numa_node("0000:d8:00.0", sysfs) is None  # not a number
    assert pci_numa_node("0000:5e:00.0", sysfs) is None  # no numa_node file
    assert pci_numa_node("0000:00:00.0", sysfs) is None  # no such device
    assert pci_numa_node("not a bus id", sysfs) is None


def test_device_numa_node_from_the_device_properties(sysfs, monkeypatch):
    """A CUDA device's bus id comes from its properties (faked here: no CUDA call); a CPU device,
    or properties without PCI ids (an old torch), give None."""
    props = {
        0: SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0),
        1: SimpleNamespace(pci_domain_id=0, pci_bus_id=0x86, pci_device_id=0),
        2: SimpleNamespace(),
    }
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert device_numa_node("cuda:0", sysfs) == 1
    assert device_numa_node(torch.device("cuda", 1), sysfs) is None
    assert device_numa_node("cuda:2", sysfs) is None
    assert device_numa_node("cpu", sysfs) is None
    assert device_numa_node("meta", sysfs) is None


def test_no_node_means_no_syscall(monkeypatch):
    def boom():
        raise AssertionError("mbind called")

    monkeypatch.setattr(memory, "_libc", boom)
    assert bind_to_numa_node(4096, 4096, None) is False
    assert bind_to_numa_node(4096, 4096, -1) is False
    assert bind_to_numa_node(4096, 0, 0) is False


def test_a_failing_placement_warns_once_and_falls_back(monkeypatch, caplog):
    """mbind refused (a node outside the cpuset, a seccomp filter): False and one warning per
    process, however many pools are placed; an unknown architecture and an out-of-range node
    the same."""
    calls = []

    class Refusing:
        @staticmethod
        def syscall(*args):
            calls.append(args)
            return -1

    monkeypatch.setattr(memory, "_libc", lambda: Refusing)
    with caplog.at_level(logging.WARNING, logger="oasiskv.memory"):
        assert bind_to_numa_node(4096, 8192, 1) is False
        assert bind_to_numa_node(4096, 8192, 1) is False
    if platform.machine() in memory._SYSCALLS:
        assert len(calls) == 2
    warnings = [r for r in caplog.records if r.name == "oasiskv.memory"]
    assert len(warnings) == 1 and "NUMA node 1" in warnings[0].getMessage()

    memory._numa_warned = False
    monkeypatch.setattr(platform, "machine", lambda: "vax")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="oasiskv.memory"):
        assert bind_to_numa_node(4096, 8192, 0) is False
    assert "no mbind syscall number for vax" in caplog.text

    monkeypatch.undo()
    memory._numa_warned = False
    assert bind_to_numa_node(4096, 8192, memory._NODE_MASK_BITS) is False


def test_a_real_placement_on_node_0():
    """Where the kernel allows mbind, the pages of a fresh aligned buffer land on node 0 when
    first touched (every Linux machine has a node 0)."""
    if platform.machine() not in memory._SYSCALLS or not Path("/sys/devices/system/node/node0").exists():
        pytest.skip("needs Linux on x86_64 or aarch64 with NUMA nodes in sysfs")
    raw, buf = memory._page_aligned(3 * memory._PAGE + 5, numa_node=0)
    assert buf.ctypes.data % memory._PAGE == 0 and buf.nbytes == 4 * memory._PAGE
    if not bind_to_numa_node(buf.ctypes.data, buf.nbytes, 0):
        pytest.skip("mbind is not allowed here")
    buf[:] = 1  # first touch
    assert numa_node_of_page(buf.ctypes.data) == 0
    assert raw.nbytes == buf.nbytes + memory._PAGE


class FakeCudart:
    """``cudaHostRegister``/``cudaHostUnregister`` that only record (no CUDA)."""

    def __init__(self, log: list, err: int = 0):
        self.log, self.err = log, err

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.log.append(("register", ptr, nbytes))
        return self.err

    def cudaHostUnregister(self, ptr):
        self.log.append(("unregister", ptr))
        return 0


@pytest.mark.parametrize("numa_node", [None, 0, 5])
def test_pinned_full_places_before_it_pins(monkeypatch, numa_node):
    """pinned_full asks for the node (when given) before cudaHostRegister faults the pages in,
    over exactly the registered range; the tensor is filled and the same with or without a node,
    and a placement that fails changes nothing else."""
    log: list = []
    real_bind = memory.bind_to_numa_node

    def bind(ptr, nbytes, node):
        log.append(("bind", ptr, nbytes, node))
        return real_bind(ptr, nbytes, node)

    monkeypatch.setattr(memory, "bind_to_numa_node", bind)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(log))
    t = memory.pinned_full((5, 3, 97), 2, torch.float16, numa_node=numa_node)
    assert t.shape == (5, 3, 97) and t.dtype == torch.float16 and bool((t == 2).all())
    assert t.data_ptr() % memory._PAGE == 0
    (b, ptr, span, node), (r, rptr, rspan) = log[:2]
    assert (b, r, node) == ("bind", "register", numa_node)
    assert (ptr, span) == (rptr, rspan) == (t.data_ptr(), 4096)
    del t
    gc.collect()  # unregistered while the stand-in is still installed
    assert log[-1] == ("unregister", ptr)


def test_pinned_full_still_raises_when_pinning_fails(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart([], err=2))
    with pytest.raises(memory.OutOfMemoryError, match="cannot pin 4.0 KiB"):
        memory.pinned_full((10,), 0, torch.float32, numa_node=0)
