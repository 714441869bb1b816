"""How much memory a device has left, and a check made before allocating.

The loaders and the engine estimate what they are about to allocate (model weights, KV pools) and
call :func:`ensure_fits` first: a config with ``vocab_size=10**11`` then fails with an
:class:`~oasiskv.errors.OutOfMemoryError` that names the sizes, instead of a raw allocator
``RuntimeError`` halfway through, or the kernel's OOM killer.

``available_bytes("cpu")`` reads ``MemAvailable`` from ``/proc/meminfo`` and the cgroup limit of
the process (a container sees the host's ``/proc/meminfo``), falling back to ``sysconf``; it needs
no psutil. ``available_bytes("cuda:N")`` is ``cudaMemGetInfo``'s free bytes plus what torch's
caching allocator holds but does not use. ``None`` means unknown: the check is then skipped.

Set ``OASIS_MEMORY_CHECK=0`` to skip the check (an estimate can be wrong, e.g. with swap).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import platform
import re
import weakref
from pathlib import Path

import torch

from .errors import OutOfMemoryError

log = logging.getLogger("oasiskv.memory")

#: Environment variable that turns :func:`ensure_fits` off when set to ``0``.
MEMORY_CHECK_ENV = "OASIS_MEMORY_CHECK"


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; for messages."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the unit is always kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """Limit minus working set of this process's cgroup (v2, then v1); None without a limit.

    The working set leaves out inactive page cache, which the kernel reclaims before it OOM-kills
    (the same definition as the kubelet's), so a large file read earlier does not count as used.
    """
    for root, limit_name, usage_name, inactive_key in (
        (Path("/sys/fs/cgroup"), "memory.max", "memory.current", "inactive_file"),
        (
            Path("/sys/fs/cgroup/memory"),
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "total_inactive_file",
        ),
    ):
        limit = _read_int(root / limit_name)
        usage = _read_int(root / usage_name)
        # v1 writes a huge number (about 2**63) for no limit
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        inactive = 0
        try:
            for line in (root / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key and value.isdigit():
                    inactive = int(value)
        except OSError:
            pass
        return max(0, limit - max(0, usage - inactive))
    return None


def _cpu_available() -> int | None:
    found = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    if not found:
        try:  # other Unixes: free pages (an underestimate: page cache counts as used)
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return min(found)


def available_bytes(device: str | torch.device = "cpu") -> int | None:
    """Bytes that can still be allocated on ``device``, or ``None`` when that cannot be told.

    ``cpu``: the smaller of ``MemAvailable`` and the cgroup's limit minus its working set.
    ``cuda[:N]``: the driver's free bytes plus torch's cached but unused blocks. Other devices
    (``meta``, ``mps``) and a CUDA device torch cannot see give ``None``.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return _cpu_available()
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        try:
            free, _total = torch.cuda.mem_get_info(index)
        except (RuntimeError, AssertionError, ValueError):
            return None
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return int(free) + max(0, int(cached))
    return None


def ensure_fits(nbytes: int, device: str | torch.device, what: str, fix: str) -> None:
    """Raise :class:`OutOfMemoryError` when ``nbytes`` exceeds :func:`available_bytes` of ``device``.

    ``what`` names the allocation and the sizes it comes from (``"the model weights
    (vocab_size=..., ...)"``); ``fix`` says how to make it smaller. Nothing happens when the free
    memory is unknown or ``OASIS_MEMORY_CHECK=0``.
    """
    if os.environ.get(MEMORY_CHECK_ENV, "1") == "0":
        return
    free = available_bytes(device)
    if free is None or nbytes <= free:
        return
    raise OutOfMemoryError(
        f"{what} would take {format_bytes(nbytes)} but only {format_bytes(free)} is free on "
        f"{torch.device(device)}; {fix} (or set {MEMORY_CHECK_ENV}=0 to skip this check)"
    )


__all__ = [
    "MEMORY_CHECK_ENV",
    "available_bytes",
    "bind_to_numa_node",
    "device_numa_node",
    "ensure_fits",
    "format_bytes",
    "pci_numa_node",
    "pinned_full",
]


# ---------------------------------------------------------------- NUMA placement
#: Where Linux lists PCI devices, one directory per bus id with a ``numa_node`` file.
PCI_DEVICES = Path("/sys/bus/pci/devices")
#: ``mbind`` and ``get_mempolicy`` syscall numbers (libnuma may be absent: they are called raw).
_SYSCALLS = {
    "x86_64": {"mbind": 237, "get_mempolicy": 239},
    "aarch64": {"mbind": 235, "get_mempolicy": 236},
}
_MPOL_PREFERRED = 1  # allocate on the node while it has free pages, elsewhere after (never OOM)
_MPOL_MF_MOVE = 1 << 1  # move pages already touched (a small allocation's heap pages)
#: Bits of the node mask passed to mbind: nodes 0 .. 1023 (Linux's default MAX_NUMNODES is far less).
_NODE_MASK_BITS = 1024
_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")
_numa_warned = False


def normalize_bus_id(bus_id: str) -> str:
    """A PCI bus id as sysfs names it, ``dddd:bb:dd.f`` in lowercase: CUDA's
    ``0000:3B:00.0`` and NVML's ``00000000:3B:00.0`` both give ``0000:3b:00.0``.

    Raises :class:`ValueError` for a string that is not a bus id."""
    m = _BUS_ID.match(bus_id.strip())
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (expected domain:bus:device.function)")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def pci_numa_node(bus_id: str, root: Path = PCI_DEVICES) -> int | None:
    """The NUMA node of the PCI device ``bus_id`` (``root/<bus id>/numa_node``), or ``None`` when
    the machine shows none: ``-1`` (one node, or a firmware that does not say), no such file, or
    text that is not a number."""
    try:
        text = (Path(root) / normalize_bus_id(bus_id) / "numa_node").read_text().strip()
        node = int(text)
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def device_numa_node(device: str | torch.device, root: Path = PCI_DEVICES) -> int | None:
    """The NUMA node nearest a CUDA ``device`` (its PCI device's, from its bus id), or ``None``:
    not a CUDA device, a torch without the PCI ids in its device properties, or a machine that
    shows no node. Never raises."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    try:
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        domain, bus, slot = props.pci_domain_id, props.pci_bus_id, props.pci_device_id
    except Exception:  # noqa: BLE001 - an old torch, no driver: no placement, not an error
        return None
    return pci_numa_node(f"{domain:04x}:{bus:02x}:{slot:02x}.0", root)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _warn_once(msg: str, *args) -> None:
    global _numa_warned
    if not _numa_warned:
        _numa_warned = True
        log.warning(msg + "; the host pool is placed by the kernel's default policy", *args)


def bind_to_numa_node(ptr: int, nbytes: int, node: int | None) -> bool:
    """Ask the kernel to place the pages of ``[ptr, ptr + nbytes)`` (page-aligned) on NUMA
    ``node`` (``mbind``, preferred policy: other nodes when that one is full; pages already
    touched are moved). Call it before the pages are first touched or pinned.

    Optional and never fatal: ``node`` ``None`` or negative does nothing; an architecture without
    known syscall numbers, or a failing ``mbind`` (no NUMA support, a seccomp filter, a node
    outside the process's cpuset) logs one warning per process and returns ``False``."""
    if node is None or node < 0 or nbytes <= 0:
        return False
    nr = _SYSCALLS.get(platform.machine(), {}).get("mbind")
    if nr is None:
        _warn_once(
            "cannot place the KV host pool on NUMA node %d: no mbind syscall number for %s",
            node,
            platform.machine(),
        )
        return False
    if node >= _NODE_MASK_BITS:
        _warn_once(
            "cannot place the KV host pool on NUMA node %d: nodes above %d are not supported",
            node,
            _NODE_MASK_BITS - 1,
        )
        return False
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (_NODE_MASK_BITS // bits))()
    mask[node // bits] = 1 << (node % bits)
    try:
        libc = _libc()
        # The kernel reads maxnode - 1 bits of the mask.
        rc = libc.syscall(
            ctypes.c_long(nr),
            ctypes.c_void_p(ptr),
            ctypes.c_ulong(nbytes),
            ctypes.c_int(_MPOL_PREFERRED),
            mask,
            ctypes.c_ulong(_NODE_MASK_BITS + 1),
            ctypes.c_uint(_MPOL_MF_MOVE),
        )
        err = ctypes.get_errno()
    except (OSError, AttributeError) as e:
        _warn_once("cannot place the KV host pool on NUMA node %d: %s", node, e)
        return False
    if rc != 0:
        _warn_once("cannot place the KV host pool on NUMA node %d: mbind failed (%s)", node, os.strerror(err))
        return False
    return True


def numa_node_of_page(ptr: int) -> int | None:
    """The NUMA node holding the (touched) page at ``ptr`` (``get_mempolicy``), or ``None`` when
    that cannot be asked. For tests and diagnostics."""
    nr = _SYSCALLS.get(platform.machine(), {}).get("get_mempolicy")
    if nr is None:
        return None
    node = ctypes.c_int(-1)
    mpol_f_node_addr = 1 | 2  # MPOL_F_NODE | MPOL_F_ADDR
    try:
        rc = _libc().syscall(
            ctypes.c_long(nr),
            ctypes.byref(node),
            None,
            ctypes.c_ulong(0),
            ctypes.c_void_p(ptr),
            ctypes.c_ulong(mpol_f_node_addr),
        )
    except (OSError, AttributeError):
        return None
    return node.value if rc == 0 else None


# ---------------------------------------------------------------- page-locked host tensors
_PAGE = 4096
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the OS frees the pages
        pass


def _page_aligned(nbytes: int, numa_node: int | None = None):
    """``(owner, buf)``: a numpy uint8 array ``buf`` of ``nbytes`` rounded up to whole pages,
    starting on a page boundary, inside the plain allocation ``owner`` (which owns the bytes),
    its pages placed on ``numa_node`` when given (:func:`bind_to_numa_node`, before any touch)."""
    import numpy as np

    span = -(-nbytes // _PAGE) * _PAGE
    raw = np.empty(span + _PAGE, dtype=np.uint8)  # untouched: a large one is a fresh mapping
    off = (-raw.ctypes.data) % _PAGE
    buf = raw[off : off + span]
    bind_to_numa_node(buf.ctypes.data, span, numa_node)
    return raw, buf


def pinned_full(shape, fill, dtype: torch.dtype, numa_node: int | None = None) -> torch.Tensor:
    """A CPU tensor of ``shape`` filled with ``fill``, in page-locked memory of exactly its size
    (rounded to whole pages), mapped for every device (UVA); its pages on NUMA node ``numa_node``
    when given (the one nearest the GPU that reads them, :func:`device_numa_node`; a placement
    that fails is logged once and the pages go where the kernel puts them).

    Why not ``pin_memory=True``: torch's caching host allocator rounds every block up to a power
    of two, so a 1.03 GiB layer of the host pool took 2 GiB of pinned RAM and the KV host pool
    could use up to twice what it holds. Here the bytes come from a plain allocation, page-aligned
    so that no page is shared with another registration, and ``cudaHostRegister`` pins them; they
    are unregistered when the last tensor viewing them is freed. The caller must not free it while
    the GPU may still read it (the engine synchronizes before it replaces a pool)."""
    nbytes = math.prod(int(s) for s in shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # The array owns the bytes; tensors keep it alive. Placed before cudaHostRegister, which
    # faults every page in.
    raw, buf = _page_aligned(nbytes, numa_node)
    span, ptr = buf.nbytes, buf.ctypes.data
    err = torch.cuda.cudart().cudaHostRegister(ptr, span, _HOST_REGISTER_PORTABLE_MAPPED)
    if int(err) != 0:
        raise OutOfMemoryError(
            f"cannot pin {format_bytes(span)} of host memory for the KV host pool (cudaHostRegister "
            f"error {int(err)}); lower host_kv_budget_bytes / KvConfig.num_host_blocks or max_num_seqs, "
            "or raise the memlock limit (ulimit -l)"
        )
    weakref.finalize(raw, _unregister, ptr)  # runs before numpy frees the bytes
    t = torch.from_numpy(buf[:nbytes]).view(dtype).view(shape)
    t.fill_(fill)
    return t
