"""The report: the sweep's dict as a markdown table (with a header of what was measured where),
as a plot, and written to the files the flags name.

It reads only the report dict (:meth:`~oasiskv.bench.fig11.Fig11.run`'s, or one loaded back from
its JSON), so a report can be re-rendered elsewhere, e.g. plotted on a machine with matplotlib.
"""

from __future__ import annotations

import json

from .budget import MAX_SEARCHED

_GIB = 2**30

#: The markdown table's columns.
COLUMNS = [
    "context", "mode", "conc", "tok/s", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 ms", "peak GPU GiB",
    "host pool GiB", "fetched/step MiB", "transfer wait/step ms", "kernels/layer/step", "roofline ms",
    "of roofline", "binds", "of HBM", "of PCIe", "of SM-read roofline", "of d2d roofline", "tok/step",
    "accept", "same tokens", "note",
]  # fmt: skip


def fmt(v, scale: float = 1.0, digits: int = 1) -> str:
    """``v * scale`` with ``digits`` decimals; ``-`` for None."""
    return "-" if v is None else f"{v * scale:.{digits}f}"


def pct(v) -> str:
    """``v`` as a whole percentage; ``-`` for None."""
    return "-" if v is None else f"{v:.0%}"


def selection_label(kv) -> str:
    """How a :class:`~oasiskv.KvConfig` selects blocks, in the eval's drafter-suffix words
    (``quest``, ``codes``, ``codes1.25+sticky+succ8``, ``+sink2``, ``+pin4``, ``+conf0.5``)."""
    parts = [kv.block_score]
    if kv.score_candidates is not None:
        parts[0] += f"{kv.score_candidates:g}"
        if kv.candidate_bound == "summaries":
            parts.append("b16")  # the first stage over the 16-bit summaries, not the 8-bit bound
    if kv.sticky_candidates:
        parts.append("sticky")
    if kv.successor_blocks:
        parts.append(f"succ{kv.successor_blocks}")
    if kv.sink_blocks:
        parts.append(f"sink{kv.sink_blocks}")
    if kv.pin_blocks:
        parts.append(f"pin{kv.pin_blocks}")
    if kv.lookahead_min_confidence is not None:
        parts.append(f"conf{kv.lookahead_min_confidence:g}")
    if kv.layer_blocks is not None:
        parts.append("layer-blocks")
    return "+".join(parts)


def markdown(rep: dict) -> str:
    """The report as a markdown table, with a header of what was measured where."""
    lines = _header_lines(rep)
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rep["rows"]:
        lines.append("| " + " | ".join(_row_cells(r)) + " |")
    return "\n".join(lines) + "\n"


def _header_lines(rep: dict) -> list[str]:
    """The bullet list above the table: model, budgets, KV options, speculative rows, ceilings,
    and per context what fits."""
    gib = _GIB
    c = rep["ceilings"]
    kv = rep["kv"]
    lines = [
        f"## Decode throughput vs concurrency (Fig. 11): {rep['model']}, {rep['device']}, {rep['dtype']}"
        + (f", TP={rep['tp']} (bytes, budgets and rooflines per rank)" if rep.get("tp", 1) > 1 else ""),
        "",
        f"- GPU KV budget {rep['gpu_kv_budget_bytes'] / gib:.1f} GiB "
        f"({budget_words(rep.get('gpu_kv_budget_kind'), rep['gpu_kv_budget'])}; "
        f"weights {rep['weights_bytes'] / gib:.1f} GiB, "
        f"activation reserve {rep['activation_reserve_bytes'] / gib:.1f} GiB); "
        f"host pool limit {rep['host_limit_bytes'] / gib:.1f} GiB",
        f"- K = {kv['top_k_blocks']} blocks of {kv['block_size']}, "
        f"fetch cap {kv['fetch_cap_blocks']} blocks, "
        f"drafter {kv['drafter']}, {rep['max_tokens']} new tokens, prompts {rep['prompts']}, "
        f"CUDA graphs {rep['cuda_graph']}",
        f"- selection: {kv.get('selection', 'quest')}",
    ]
    sp = rep.get("speculative")
    if sp:
        lines += _speculative_lines(sp, kv)
    if c:
        hbm = c.get("hbm_read_Bps")
        lines.append(
            "- measured here: "
            + (f"HBM read {hbm / 1e9:.0f} GB/s, " if hbm else "")
            + f"device-to-device copy {c['d2d_copy_Bps'] / 1e9:.0f} GB/s (read + write), "
            f"pinned host-to-device {c['h2d_pinned_Bps'] / 1e9:.1f} GB/s"
            + (
                f" (copy engines; SM reads of pinned memory {c['h2d_sm_Bps'] / 1e9:.1f} GB/s)"
                if c.get("h2d_sm_Bps")
                else ""
            )
        )
    if c and c.get("hbm_read_Bps"):
        lines.append(
            "- roofline: the larger of a step's HBM time (weights and the KV attention reads, over "
            "the HBM read bandwidth) and its PCIe time (bytes fetched from the pinned host pool, over "
            "the pinned host-to-device bandwidth); 'of roofline' is it over the measured step, 'binds' "
            "the larger, 'of SM-read roofline' the same bound with the PCIe time at what an SM kernel "
            "reads of pinned memory (the gathers' path, below the copy engines on some hosts), 'of d2d "
            "roofline' the reads over the copy bandwidth (the bound before issue 35)"
        )
    for ctx, info in rep["contexts"].items():
        fills = info.get("dense_fills_budget_at")
        mc = ", ".join(
            f"{m} {f'>= {MAX_SEARCHED}' if n is None else n}" for m, n in info["max_concurrency"].items()
        )
        budget = info.get("gpu_kv_budget_bytes")
        lines.append(
            f"- context {ctx}: "
            + (
                f"GPU KV budget {budget / gib:.2f} GiB ({info['gpu_kv_budget_kind']}); "
                if budget is not None
                else ""
            )
            + f"{info['request_kv_bytes'] / gib:.2f} GiB of KV per request; most requests "
            f"that fit: {mc}"
            + (f"; dense fills its KV budget at concurrency {fills}" if fills else "")
            + "".join(
                f"; {m}'s drafter {b / 2**20:.1f} MiB per request"
                for m, b in info.get("drafter_bytes", {}).items()
                if b
            )
            + f"; cold TTFT {fmt(info['ttft_cold_s'], 1e3)} ms"
        )
    return lines


def budget_words(kind: str | None, flag) -> str:
    """The header's name of the GPU KV budget (:class:`~.budget.GpuKvBudget`'s ``kind``; a report
    from before issue 35 has none and its flag was ``h100`` or a size)."""
    if kind == "real":
        return "real: the card's free memory beside the weights, less the activation reserve"
    if kind == "given" or (kind is None and not isinstance(flag, str)):
        return "given"
    return "emulated: an 80 GiB H100 less the weights and the activation reserve"


def _speculative_lines(sp: dict, kv: dict) -> list[str]:
    """The header's bullets on the speculative rows: their drafter and what its draft costs."""
    lines = []
    if sp["draft_acceptance"]:
        cost = (
            f"a random EAGLE-3 head of the target's shape ({sp['draft_head_bytes'] / _GIB:.2f} GiB) "
            "runs beside it every step, its drafts discarded"
            if sp["draft_cost"] == "eagle3"
            else "nothing (no head runs: an upper bound)"
        )
        if sp.get("draft_verdicts") == "forced":
            lines.append(
                "- speculative rows (`+spec@a`): an oracle drafter whose verdicts are FORCED: a draft "
                "is accepted with probability a by a hash of (seed, request, position), whatever the "
                "logits say (a hit does the work of an acceptance: the draft's K/V stored, two "
                "tokens; a miss that of a rejection), so the tokens are NOT the model's greedy "
                f"outputs (a throughput measurement only); its draft costs {cost}"
            )
        else:
            lines.append(
                "- speculative rows (`+spec@a`): an oracle drafter right with probability a, verified "
                f"by the engine; its draft costs {cost}; reference iterated until a round reproduces "
                f"it, at most {sp['oracle_rounds']} rounds"
            )
    else:
        lines.append(f"- speculative rows (`+spec`): drafter {kv['drafter']}, verified by the engine")
    lines.append(
        "- TPOT is step time over tokens made per request; roofline against the step time; "
        "same tokens: the fraction equal to the base mode's row"
    )
    return lines


def _row_cells(r: dict) -> list[str]:
    """One row of the table, a cell per :data:`COLUMNS` entry."""
    gib = _GIB
    # A "--concurrency max" level that could not run has no concurrency (resolve_concurrency).
    cells = [str(r["context"]), r["mode"], "max" if r["concurrency"] is None else str(r["concurrency"])]
    if r["status"] != "ok":
        return cells + ["-"] * (len(COLUMNS) - 4) + [f"skipped: {r['reason']}"]
    return cells + [
        fmt(r["decode_tokens_per_s"]),
        fmt(r["tpot_p50_s"], 1e3, 2),
        fmt(r["tpot_p99_s"], 1e3, 2),
        fmt(r["ttft_p50_s"], 1e3),
        fmt(r["peak_gpu_bytes"], 1 / gib, 2),
        fmt(r["host_pool_bytes"], 1 / gib, 2),
        fmt(r["fetched_bytes_per_step"], 1 / 2**20, 2),
        fmt(r.get("transfer_wait_per_step_s") if r["mode"] != "dense" else None, 1e3, 3),
        fmt(r["kernels_per_layer_step"]),
        fmt(r["roofline_tpot_s"], 1e3, 2),
        pct(r["roofline_fraction"]),
        r.get("roofline_binds") or "-",
        pct(r.get("hbm_fraction")),
        pct(r.get("pcie_fraction")),
        pct(r.get("roofline_sm_fraction")),
        pct(r.get("roofline_fraction_d2d")),
        fmt(r.get("tokens_per_step"), digits=2),
        fmt(r.get("acceptance_rate"), digits=3),
        "-" if r.get("tokens_match_base") is None else f"{r['tokens_match_base']:.0%}",
        "; ".join(x for x in (kv_note(r), host_note(r), ref_note(r)) if x),
    ]


def host_note(r: dict) -> str:
    """Where an OasisKV row's host pool lived (empty for dense rows)."""
    return r["host_pool_place"] if r["mode"] != "dense" else ""


def kv_note(r: dict) -> str:
    """The row's KV dtypes: ``KV bfloat16``, ``KV fp8_e4m3``, or with a host pool of another dtype
    ``KV bfloat16, host fp8_e4m3`` (rows of older reports, without the fields: empty)."""
    kv, host = r.get("kv_dtype"), r.get("host_kv_dtype")
    if kv is None:
        return ""
    return f"KV {kv}" + (f", host {host}" if host not in (None, kv) else "")


def ref_note(r: dict) -> str:
    """How an oracle row's verdicts were made: forced, or how its reference ended (empty for
    other rows)."""
    if r.get("draft_verdicts") == "forced":
        return "verdicts forced: tokens are not the model's"
    if r.get("reference_rounds") is None:
        return ""
    if r["reference_converged"]:
        return f"reference in {r['reference_rounds']} rounds"
    return (
        f"reference NOT reached in {r['reference_rounds']} rounds "
        f"({r['off_reference_requests']} requests left it)"
    )


def plot(rep: dict, path: str) -> None:
    """Decode throughput vs concurrency: one panel per context, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = list(rep["contexts"])
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs, strict=True):
        for mode in dict.fromkeys(r["mode"] for r in rep["rows"]):
            pts = [
                (r["concurrency"], r["decode_tokens_per_s"])
                for r in rep["rows"]
                if str(r["context"]) == ctx and r["mode"] == mode and r["status"] == "ok"
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=mode)
        fills = rep["contexts"][ctx].get("dense_fills_budget_at")
        tested = [r["concurrency"] or 0 for r in rep["rows"] if str(r["context"]) == ctx]
        if fills and fills <= 2 * max(tested):
            ax.axvline(fills, color="grey", linestyle=":", label="dense fills its budget")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"context {ctx}")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a context whose every row was skipped has none
            ax.legend()
    fig.suptitle(f"{rep['model']} on {rep['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(args, rep: dict) -> str:
    """Write the JSON and markdown reports where ``args`` say (``--json``, ``--md``; empty or
    None: not written); returns the markdown."""
    md = markdown(rep)
    for path, text in ((args.json, json.dumps(rep, indent=2)), (args.md, md)):
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    return md
