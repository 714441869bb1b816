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

import os
import weakref
from pathlib import Path

import torch

from .errors import OutOfMemoryError

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


__all__ = ["MEMORY_CHECK_ENV", "available_bytes", "ensure_fits", "format_bytes"]


# ---------------------------------------------------------------- page-locked host tensors
_PAGE = 4096
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the OS frees the pages
        pass


def pinned_full(shape, fill, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` filled with ``fill``, in page-locked memory of exactly its size
    (rounded to whole pages), mapped for every device (UVA).

    Why not ``pin_memory=True``: torch's caching host allocator rounds every block up to a power
    of two, so a 1.03 GiB layer of the host pool took 2 GiB of pinned RAM and the KV host pool
    could use up to twice what it holds. Here the bytes come from a plain allocation, page-aligned
    so that no page is shared with another registration, and ``cudaHostRegister`` pins them; they
    are unregistered when the last tensor viewing them is freed. The caller must not free it while
    the GPU may still read it (the engine synchronizes before it replaces a pool)."""
    import numpy as np

    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    span = -(-nbytes // _PAGE) * _PAGE
    raw = np.empty(span + _PAGE, dtype=np.uint8)  # the array owns the bytes; tensors keep it alive
    off = (-raw.ctypes.data) % _PAGE
    buf = raw[off : off + span]
    ptr = buf.ctypes.data
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
