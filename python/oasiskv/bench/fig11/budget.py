"""What fits: the GPU KV budget, the host pool limit, and whether ``C`` requests of a context fit
them in a mode (and the most that do).

Pure arithmetic over byte counts: the caller measures one request's reservation (its pages, host
blocks and their bytes, :meth:`~oasiskv.bench.fig11.Fig11.need`) and the device's free memory,
and hands them in.

The GPU KV budget (:func:`choose_gpu_kv_budget`) is ``real``, ``emulated`` or ``given``. Real:
what the card has free, measured as the engine's own memory check measures it
(:func:`oasiskv.memory.available_bytes`: the driver's free bytes plus torch's cached blocks)
beside the weights and the context's prefill cache, less the activations a row needs beside its
pools. Emulated (``--gpu-kv-budget h100``): an 80 GiB H100's HBM less the weights and a reserve
for the CUDA context, the prefill cache and activations. The default, ``auto``, is real on an
H100 and emulated elsewhere. On the real H100 the emulated budget said dense fits 13 requests of
32K where the engine's check refused 13 (58.6 GiB needed, 58.5 free): issue 35.

A request's reservation, ``need``, is a dict of

* ``peak_pages``: GPU pages at its dense-phase peak (its working set when ``prefills_sparse``:
  the engine admits the prompt sparse and prefills it straight into the host pool);
  ``steady_pages``: its working set once sparse (``top_k_blocks + 1``);
* ``host_blocks``: the blocks of its KV in the host pool; ``kv_blocks``: every block of its KV
  (the peak pages for dense, the host blocks otherwise);
* ``block_bytes``: a block's K and V over all layers (GPU pages); ``host_block_bytes``: the
  same in the host pool (about half with ``--host-kv-dtype fp8_e4m3``); ``summary_bytes``: its
  GPU-resident metadata (summaries, and with the codes block score -- the default selection --
  key codes and the 8-bit bound, about as many bytes again: issue 35's 64K/128K rows ran out of
  memory when only the summaries were counted); ``score_bytes``: what the roofline counts a step's
  scoring as reading of it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The emulated GPU of ``--gpu-kv-budget h100``. Arbitrary round figure: 80 GiB of HBM3 (torch
#: reports a little less, 79.2 GiB, as total_memory of an H100 SXM).
H100_BYTES = 80 * 2**30
#: Left for activations when the budget is ``h100``. Arbitrary, checked by the peak memory: a 32K
#: prompt prefilled in one piece on an 8B model takes about 3 GiB beyond weights and KV.
ACTIVATION_RESERVE_BYTES = 6 * 2**30
#: Left for a row's activations beside its pools under a real budget, with ``--prompts shared``:
#: the free bytes it comes from are measured beside the weights, the CUDA context and the prefill
#: cache, so only the row's own activations remain. Tuned with a margin: H200 dense rows with
#: shared prompts peaked 0.1-0.4 GiB above weights, pools and cache (results/bench/h200-*, 16K and
#: 32K, up to 26 requests). ``--prompts distinct`` prefills at row time and keeps
#: :data:`ACTIVATION_RESERVE_BYTES`.
REAL_ACTIVATION_RESERVE_BYTES = 1 * 2**30
#: Headroom over a measured admission transient (:func:`admission_excess`): the allocator rounds
#: and splits blocks, so a transient of N bytes can need more free. Arbitrary.
ADMISSION_MARGIN = 1.1
#: The device names whose budget ``auto`` takes from the card (substrings of
#: ``torch.cuda.get_device_name``): the GPU the paper and issue 35 measure on.
REAL_BUDGET_DEVICES = ("H100",)
#: ``--gpu-kv-budget`` words (a size is the other choice).
BUDGET_WORDS = ("auto", "real", "h100")
#: The host pool limit without ``--host-kv-budget``: this fraction of the available RAM (arbitrary;
#: pinned memory is never swapped or reclaimed, so leave the rest to the process and the system).
HOST_RAM_FRACTION = 0.6
#: The most concurrent requests the report's "most that fit" looks for (arbitrary).
MAX_SEARCHED = 1 << 16
#: ``--concurrency max``: a level that stands for each mode's largest concurrency that fits
#: (:func:`max_concurrency`), resolved per context and mode (:func:`resolve_concurrency`).
MAX_FITTING = -1


@dataclass(frozen=True)
class Budgets:
    """The limits a row must fit, in bytes (per rank under ``--tp``)."""

    gpu_kv: int  # KV pages and summaries on the GPU
    host_limit: int  # the oasis host pool
    activation_reserve: int  # left free beside the oracle's device-resident host pool


def gpu_kv_budget(budget: str | int, weights_bytes: int, activation_reserve: int) -> int:
    """The GPU KV budget of ``--gpu-kv-budget``: a size as given, or for ``"h100"`` what an
    80 GiB H100 leaves beside the weights and the activation reserve.

    # Errors
    ``ConfigError`` when the weights leave no KV budget on an H100.
    """
    if budget != "h100":
        return budget
    out = H100_BYTES - weights_bytes - activation_reserve
    if out <= 0:
        from ...errors import ConfigError

        raise ConfigError(f"the weights ({weights_bytes / 2**30:.1f} GiB) leave no KV budget on an H100")
    return out


@dataclass(frozen=True)
class GpuKvBudget:
    """The GPU KV budget a row used: ``kind`` ``"real"`` (the card's free bytes less the
    reserve), ``"emulated h100"`` or ``"given"`` (a size on the command line), and its ``bytes``."""

    kind: str
    bytes: int


def activation_reserve(flag: int | None, budget_flag: str | int, device_name: str, prompts: str) -> int:
    """The activation reserve: ``--activation-reserve`` when given, else
    :data:`REAL_ACTIVATION_RESERVE_BYTES` when the budget is real and the prompts are
    ``shared`` (a row then prefills nothing), else :data:`ACTIVATION_RESERVE_BYTES`."""
    if flag is not None:
        return flag
    if budget_kind(budget_flag, device_name) == "real" and prompts == "shared":
        return REAL_ACTIVATION_RESERVE_BYTES
    return ACTIVATION_RESERVE_BYTES


def budget_kind(flag: str | int, device_name: str) -> str:
    """Which budget ``--gpu-kv-budget`` ``flag`` means on ``device_name``
    (``torch.cuda.get_device_name``, or ``"cpu"``): ``"given"`` for a size, ``"emulated h100"``
    for ``"h100"``, ``"real"`` for ``"real"``, and for ``"auto"`` real on a device named in
    :data:`REAL_BUDGET_DEVICES`, emulated elsewhere."""
    if not isinstance(flag, str):
        return "given"
    if flag == "auto":
        return "real" if any(d in device_name for d in REAL_BUDGET_DEVICES) else "emulated h100"
    if flag == "h100":
        return "emulated h100"
    if flag == "real":
        return "real"
    raise ValueError(f"--gpu-kv-budget is a size or one of {BUDGET_WORDS}, got {flag!r}")


def choose_gpu_kv_budget(
    flag: str | int,
    device_name: str,
    free_bytes: int | None,
    weights_bytes: int,
    activation_reserve: int,
) -> GpuKvBudget:
    """The GPU KV budget of ``--gpu-kv-budget`` ``flag`` (:func:`budget_kind`) on
    ``device_name``: a given size as it is; emulated, :func:`gpu_kv_budget`; real,
    ``free_bytes`` (measured beside the weights already loaded, so ``weights_bytes`` is not
    subtracted again) less ``activation_reserve``.

    # Errors
    ``ConfigError`` when a real budget has no free bytes to come from (no CUDA device), or when
    the weights (emulated) or the reserve (real) leave no KV budget.
    """
    from ...errors import ConfigError

    kind = budget_kind(flag, device_name)
    if kind == "given":
        return GpuKvBudget(kind, int(flag))
    if kind == "emulated h100":
        return GpuKvBudget(kind, gpu_kv_budget("h100", weights_bytes, activation_reserve))
    if free_bytes is None:
        raise ConfigError(
            f"--gpu-kv-budget real needs a CUDA device's free memory, and {device_name} has none to "
            "tell: pass a size or h100"
        )
    out = free_bytes - activation_reserve
    if out <= 0:
        raise ConfigError(
            f"{free_bytes / 2**30:.1f} GiB free on {device_name} leave no KV budget beside the "
            f"{activation_reserve / 2**30:.1f} GiB activation reserve: lower --activation-reserve"
        )
    return GpuKvBudget(kind, out)


def host_kv_limit(host_kv_budget: int | None, available_ram: int | None) -> int:
    """The host pool limit: ``--host-kv-budget``, else :data:`HOST_RAM_FRACTION` of the RAM."""
    return host_kv_budget or int(HOST_RAM_FRACTION * (available_ram or 0))


def admission_excess(need: dict, budgets: Budgets) -> int:
    """Bytes a mode's admission needs on the device beside the running requests' pools past the
    activation reserve the GPU budget already leaves: ``need["admission_bytes"]`` (the transient
    peak of one warm admission, measured on the device by the sweep; absent or None: nothing
    measured) less ``budgets.activation_reserve``, never below 0. Per mode, so that the EAGLE-3
    head's admission (OasisKV rows) lowers no dense row's budget."""
    measured = need.get("admission_bytes")
    if not measured:
        return 0
    return max(0, int(measured * ADMISSION_MARGIN) - budgets.activation_reserve)


def fit(
    mode: str, conc: int, need: dict, budgets: Budgets, device_free: int | None
) -> tuple[str | None, int, int | None]:
    """``(reason it does not fit or None, GPU budget, host budget)`` of ``conc`` requests of one
    ``need`` in a base ``mode`` (``dense``, ``oasis``, ``oracle``); ``device_free``: the device's
    free bytes (None: not checked)."""
    gib = 2**30
    per = need["block_bytes"]
    # What the mode's admission needs beside the pools past the budget's activation reserve
    # (need["admission_bytes"], measured: :func:`admission_excess`) comes off its budget.
    budget = budgets.gpu_kv - admission_excess(need, budgets)
    # The drafter's per-request device state (the EAGLE-3 head's KV) shares the budget.
    drafter = conc * need.get("drafter_bytes", 0)
    if mode == "dense":
        dense = conc * need["peak_pages"] * per
        if dense + drafter > budget:
            what = "dense KV" if not drafter else "dense KV + drafter"
            return f"{what} {(dense + drafter) / gib:.1f} GiB > GPU KV budget {budget / gib:.1f} GiB", 0, None
        return None, budget - drafter, None
    # Admission turns one request sparse before the next is prefilled: (C - 1) working sets
    # and one dense prompt at the peak (a working set too when the prompt is prefilled sparse);
    # every request's summaries stay on the GPU.
    pages = (conc - 1) * need["steady_pages"] + need["peak_pages"]
    summaries = conc * need["host_blocks"] * need["summary_bytes"]
    host = conc * need["host_blocks"] * need.get("host_block_bytes", per)
    if pages * per + summaries + drafter > budget:
        gpu = (pages * per + summaries + drafter) / gib
        what = "pages + summaries" + (" + drafter" if drafter else "")
        return f"{what} {gpu:.1f} GiB > GPU KV budget {budget / gib:.1f} GiB", 0, None
    if mode == "oasis" and host > budgets.host_limit:
        return f"host pool {host / gib:.1f} GiB > host limit {budgets.host_limit / gib:.1f} GiB", 0, None
    if mode == "oracle" and device_free is not None:
        room = device_free - budgets.activation_reserve - pages * per - summaries - drafter
        if host > room:
            return (
                f"full KV on the device {host / gib:.1f} GiB > {max(room, 0) / gib:.1f} GiB free",
                0,
                None,
            )
    return None, pages * per, host


def max_concurrency(
    mode: str, need: dict, budgets: Budgets, device_free: int | None, limit: int = MAX_SEARCHED
) -> int | None:
    """The largest concurrency that fits (:func:`fit`; 0: not even one request; None: ``limit`` or
    more), by bisection."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fit(mode, mid, need, budgets, device_free)[0] is None:
            lo = mid
        else:
            hi = mid - 1
    return None if lo == limit else lo


def resolve_concurrency(level: int, most: int | None) -> tuple[int | None, str | None]:
    """``(concurrency, reason it cannot run)`` of a ``--concurrency`` ``level``: itself, or for
    :data:`MAX_FITTING` the mode's ``most`` that fit (:func:`max_concurrency`; 0 when not even
    one request fits, None when :data:`MAX_SEARCHED` or more do)."""
    if level != MAX_FITTING:
        return level, None
    if most is None:
        return None, f"--concurrency max: {MAX_SEARCHED} or more requests fit; name a concurrency"
    if most == 0:
        return None, "--concurrency max: not even one request fits the budgets"
    return most, None
