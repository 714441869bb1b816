"""Render ``results.json`` into ``results.md`` (tables) and PNG plots (matplotlib, Agg backend).

Plots are skipped with a note when matplotlib is not installed (the GPU machine may lack it):
copy ``results.json`` back and run ``oasis eval --report-only --out DIR`` where it is.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

# eagle3-prefill: results written before the library drafter prefilled its head (same as eagle3 now).
DRAFTER_ORDER = (
    "eagle3",
    "eagle3+current",
    "eagle3-noprefill",
    "eagle3-prefill",
    "ngram",
    "oracle",
    "previous-query",
)


def _kept_cell(k: dict | None) -> str:
    """The overlap against the selection's own choice (sticky candidates: the true query's top-K
    keeps what the prediction kept), with its matched / not matched split; "-" without."""
    if not k:
        return "-"
    return f"{_f(k.get('overlap'))} ({_f(k.get('overlap_matched'))} / {_f(k.get('overlap_unmatched'))})"


def _f(x, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}"


def _pct(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:+.{nd}f}"


def _mb(x) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f} MB"
    return f"{x / 1e3:.1f} KB"


def _cap(c) -> str:
    return "none" if c is None else str(c)


def _budget_key(label) -> float:
    if label is None:
        return -1.0
    from fractions import Fraction

    if str(label).endswith("b"):
        return 1000.0 + int(str(label)[:-1])
    return float(Fraction(label))


def _cap_key(c) -> float:
    return math.inf if c is None else float(c)


def _drafter_key(d) -> int:
    return DRAFTER_ORDER.index(d) if d in DRAFTER_ORDER else len(DRAFTER_ORDER)


def _config_order(r: dict) -> tuple:
    """Budget, then cap, then drafter: the row order of the per-configuration tables."""
    return (_budget_key(r["budget"]), _cap_key(r.get("fetch_cap")), _drafter_key(r["drafter"]))


def _records(data: dict, section: str) -> list[dict]:
    return [r for r in data.get("records", []) if r.get("section") == section]


def _by(recs, field) -> dict:
    out: dict = {}
    for r in recs:
        out.setdefault(r.get(field), []).append(r)
    return out


def _by_setting(recs) -> list[tuple[str, str, list[dict]]]:
    """Teacher-forced records grouped by (context, continuation, steps, texts), in order: (title,
    file tag, records). ``continuation`` is absent for held-out text (the default) and "greedy"
    when the texts continue with dense greedy decoding (``oasis eval --continuation greedy``).
    Runs of one context with other step or text counts (``--texts 14`` beside ``--texts 4``) are
    groups of their own, so that no table cell mixes them; their file tags end in
    ``-{steps}x{texts}``."""
    groups: dict = {}
    for r in recs:
        cont = (r.get("continuation") or "text") + (f"+{r['kv_dtype']}" if r.get("kv_dtype") else "")
        key = (r.get("context"), cont, r.get("steps") or 0, r.get("texts") or 0)
        groups.setdefault(key, []).append(r)
    sizes: dict = {}
    for ctx, cont, steps, texts in groups:
        sizes.setdefault((ctx, cont), set()).add((steps, texts))
    out = []
    for key in sorted(groups, key=lambda k: (k[0], k[1] != "text", k[1], k[2], k[3])):
        ctx, cont, steps, texts = key
        text, _, kv = cont.partition("+")  # "+fp8_e4m3": an --kv-dtype run, a group of its own
        title, tag = (
            (f"{ctx}", f"C{ctx}") if text == "text" else (f"{ctx}, {text} continuation", f"C{ctx}-{text}")
        )
        if kv:
            title, tag = f"{title}, {kv} KV", f"{tag}-{kv}"
        if len(sizes[ctx, cont]) > 1:
            tag += f"-{steps}x{texts}"
        out.append((title, tag, groups[key]))
    return out


# ------------------------------------------------------------------------------------------ markdown
def render_markdown(data: dict) -> str:
    lines: list[str] = ["# OasisKV accuracy evaluation", ""]
    runs = data.get("runs", [])
    if runs:
        m = runs[-1]
        mc = m.get("model_config", {})
        lines += [
            f"Model `{m.get('model')}` ({mc.get('family')}, {mc.get('num_hidden_layers')} layers, "
            f"{mc.get('num_attention_heads')}/{mc.get('num_key_value_heads')} heads), EAGLE-3 head "
            f"`{m.get('eagle3')}`; {m.get('device')} ({m.get('device_name')}), {m.get('dtype')}; torch "
            f"{m.get('torch')}, oasiskv {m.get('oasiskv')} ({m.get('git_commit') or 'no git'}); held-out "
            f"corpus `{m.get('corpus_source')}` fingerprint `{m.get('corpus_fingerprint')}`.",
            "",
            "Commands that produced these records:",
            "",
        ]
        seen = set()
        for r in runs:
            argv = r.get("argv") or []
            cmd = " ".join(["oasis eval", *argv[argv.index("eval") + 1 :]] if "eval" in argv else argv)
            if cmd not in seen:
                seen.add(cmd)
                lines.append(f"    {cmd}")
        lines.append("")
    teacher = _records(data, "teacher")
    if teacher:
        lines += _lookahead_md(teacher) + _fidelity_md(teacher)
    ret = _records(data, "retrieval")
    if ret:
        lines += _retrieval_md(ret)
    return "\n".join(lines) + "\n"


def _lookahead_md(recs: list[dict]) -> list[str]:
    out = [
        "## Lookahead accuracy",
        "",
        "Overlap = |predicted top-K ∩ exact top-K of the next step's true query| / |exact|, per KV head, "
        "averaged over heads, layers, decode steps (the first sparse step excluded) and texts; the "
        "smallest per-layer mean in parentheses. Working-set hit: the same against the blocks that "
        "were actually resident (what the fetch cap let in).",
        "",
    ]
    for ctx, _, rs in _by_setting([r for r in recs if r.get("policy") == "oasis"]):
        drafters = sorted({r["drafter"] for r in rs}, key=_drafter_key)
        r0 = rs[0]
        out += [f"### Context {ctx} ({r0.get('steps')} steps x {r0.get('texts')} texts)", ""]
        out.append("| budget | K | cap | " + " | ".join(drafters) + " |")
        out.append("|" + "---|" * (3 + len(drafters)))
        rows = _by(rs, "budget")
        for bud in sorted(rows, key=_budget_key):
            for cap, cr in sorted(_by(rows[bud], "fetch_cap").items(), key=lambda kv: _cap_key(kv[0])):
                d = {r["drafter"]: r.get("lookahead", {}) for r in cr}
                cells = [
                    f"{_f(d[x].get('overlap'))} ({_f(d[x].get('overlap_min_layer'), 2)})" if x in d else "-"
                    for x in drafters
                ]
                out.append(
                    f"| {bud} | {cr[0].get('top_k_blocks')} | {_cap(cap)} ({cr[0].get('cap_blocks')}) | "
                    + " | ".join(cells)
                    + " |"
                )
        out += [
            "",
            "| budget | cap | drafter | draft = next token | overlap, matched | overlap, not matched | "
            "working-set hit | own choice: overlap (matched / not) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for bud in sorted(rows, key=_budget_key):
            for r in sorted(
                rows[bud], key=lambda r: (_cap_key(r.get("fetch_cap")), _drafter_key(r["drafter"]))
            ):
                la = r.get("lookahead", {})
                out.append(
                    f"| {bud} | {_cap(r.get('fetch_cap'))} | {r['drafter']} | {_f(la.get('draft_accept'))} | "
                    f"{_f(la.get('overlap_matched'))} ({la.get('n_matched', 0)}) | "
                    f"{_f(la.get('overlap_unmatched'))} ({la.get('n_unmatched', 0)}) | "
                    f"{_f(la.get('resident_hit'))} | {_kept_cell(la.get('kept'))} |"
                )
        massed = [r for r in rs if r.get("lookahead", {}).get("attn_mass")]
        if massed:
            out += [
                "",
                "Share of the true query's exact softmax attention (whole context, mean over heads) that "
                "falls in each block set, local block included; sampled steps (`--attn-mass-every`). "
                "Exact top-K is what the Quest-like ideal reads; resident is what this step attended over; "
                "best is the K blocks of most attention (the ceiling of any block scoring at this budget).",
                "",
                "| budget | cap | drafter | exact top-K | predicted | predicted, matched | "
                "predicted, not matched | resident | best | cells |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in sorted(massed, key=_config_order):
                m = r["lookahead"]["attn_mass"]
                out.append(
                    f"| {r['budget']} | {_cap(r.get('fetch_cap'))} | {r['drafter']} | {_f(m.get('exact'))} | "
                    f"{_f(m.get('predicted'))} | {_f(m.get('predicted_matched'))} | "
                    f"{_f(m.get('predicted_unmatched'))} | {_f(m.get('resident'))} | {_f(m.get('best'))} | "
                    f"{m.get('cells')} |"
                )
        top2 = [r for r in rs if r.get("lookahead", {}).get("top2")]
        if top2:
            out += [
                "",
                "Lookahead from the head's two best drafts (`+top2`, a measurement: the engine ran the best "
                "draft). Each draft's query is rebuilt one step late with dense attention; top-1 is the best "
                "draft's set (the control), union by rank alternates the two drafts' top-K lists, union by "
                "max ranks each block by the larger of its two scores relative to each query's best block. "
                "Overlap with the exact top-K / attention share:",
                "",
                "| budget | cap | drafter | runner-up = next token | top-1 | union by rank | union by max |",
                "|---|---|---|---|---|---|---|",
            ]
            for r in sorted(top2, key=_config_order):
                t = r["lookahead"]["top2"]
                ov, am = t["overlap"], t.get("attn_mass", {})
                cells = [f"{_f(ov.get(k))} / {_f(am.get(k))}" for k in ("top1", "union_rank", "union_max")]
                out.append(
                    f"| {r['budget']} | {_cap(r.get('fetch_cap'))} | {r['drafter']} | "
                    f"{_f(t.get('runner_up_accept'))} | " + " | ".join(cells) + " |"
                )
        binned = [r for r in rs if r.get("lookahead", {}).get("by_confidence")]
        if binned:
            edges = [(b["lo"], b["hi"]) for b in binned[0]["lookahead"]["by_confidence"]]
            out += [
                "",
                "By the head's probability of its draft (share of steps / draft = next token / overlap):",
                "",
                "| budget | cap | drafter | "
                + " | ".join(f"p in [{lo:g}, {hi:g}]" for lo, hi in edges)
                + " |",
                "|" + "---|" * (3 + len(edges)),
            ]
            for r in sorted(binned, key=_config_order):
                cells = [
                    f"{_f(b['share'], 2)} / {_f(b['accept'], 2)} / {_f(b['overlap'])}"
                    for b in r["lookahead"]["by_confidence"]
                ]
                out.append(
                    f"| {r['budget']} | {_cap(r.get('fetch_cap'))} | {r['drafter']} | "
                    + " | ".join(cells)
                    + " |"
                )
        out.append("")
    return out


def _fidelity_md(recs: list[dict]) -> list[str]:
    out = [
        "## Decode fidelity against dense (teacher-forced; the shape of the paper's Table 2)",
        "",
        "ΔNLL % = (NLL - NLL_dense) / NLL_dense over every teacher-forced step; vs Quest % = the same "
        "against the Quest-like policy at the same budget (current-query top-K, all resident); KL = "
        "KL(dense || policy) in nats per token; top-1 = share of steps whose argmax equals dense's. "
        "Fetched = host-to-GPU KV bytes per decode step, all layers (Quest: what its selection changes "
        "would fetch, uncapped).",
        "",
    ]
    for ctx, _, rs in _by_setting(recs):
        dense = [r for r in rs if r.get("policy") == "dense"]
        r0 = rs[0]
        out.append(f"### Context {ctx} ({r0.get('steps')} steps x {r0.get('texts')} texts)")
        out.append("")
        if dense:
            out += [f"Dense NLL {_f(dense[0]['nll'], 4)} (perplexity {_f(dense[0]['ppl'], 2)}).", ""]
        out += [
            "| budget | K | policy | cap | fetched / step | ΔNLL % | vs Quest % | KL | top-1 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        rows = _by([r for r in rs if r.get("policy") != "dense"], "budget")
        for bud in sorted(rows, key=_budget_key):
            ordered = sorted(
                rows[bud],
                key=lambda r: (
                    r["policy"] != "quest",
                    _cap_key(r.get("fetch_cap")),
                    _drafter_key(r.get("drafter")),
                ),
            )
            quest = next((r for r in ordered if r["policy"] == "quest"), None)
            for r in ordered:
                vs_quest = r.get("delta_vs_quest_pct")
                if vs_quest is None and quest is not None and r["policy"] == "oasis" and r.get("nll"):
                    # A run without --no-quest's reference, merged beside one: same texts and budget.
                    vs_quest = 100.0 * (r["nll"] - quest["nll"]) / quest["nll"]
                if r["policy"] == "quest":
                    name, cap, fetched = "Quest-like", "-", f"({_mb(r.get('would_fetch_bytes_per_step'))})"
                else:
                    name = f"OasisKV {r['drafter']}" + (
                        " (FreeKV-like)" if r["drafter"] == "previous-query" else ""
                    )
                    cap, fetched = _cap(r.get("fetch_cap")), _mb(r.get("fetched_bytes_per_step"))
                se = r.get("delta_nll_se")
                dn = _pct(r.get("delta_nll_pct")) + (
                    f" ± {100 * se / r['nll_dense']:.2f}" if se is not None and r.get("nll_dense") else ""
                )
                out.append(
                    f"| {bud} | {r.get('top_k_blocks')} | {name} | {cap} | {fetched} | {dn} | "
                    f"{_pct(vs_quest)} | {_f(r.get('kl'), 4)} | "
                    f"{_f(r.get('top1_agree'))} |"
                )
        out.append("")
    return out


def _column(r: dict) -> tuple:
    """A retrieval record's column: its policy, budget, drafter and (an --kv-dtype run) KV dtype."""
    return (r["policy"], r.get("budget"), r.get("drafter"), r.get("kv_dtype"))


def _retrieval_md(recs: list[dict]) -> list[str]:
    out = [
        "## Retrieval accuracy (greedy; passkey, needle, key-value)",
        "",
        "Accuracy over all trials of a task (depths cycle through the listed ones); `overall` is the "
        "mean over tasks. Dense and sparse runs decode the same prompts. A cell marked (k/n) is "
        "partial: a time limit stopped it after k of n trials (`--resume` continues it).",
        "",
    ]
    for ctx, rs in sorted(_by(recs, "context").items()):
        cols: list[tuple] = []
        for r in sorted(
            rs, key=lambda r: (r["policy"] != "dense", _budget_key(r.get("budget")), r["policy"])
        ):
            c = _column(r)
            if c not in cols:
                cols.append(c)
        names = [
            ("dense" if p == "dense" else (f"Quest-like {b}" if p == "quest" else f"OasisKV {b} ({d})"))
            + (f", {kv} KV" if kv else "")
            for p, b, d, kv in cols
        ]
        out += [f"### Context {ctx}", "", "| task | trials | " + " | ".join(names) + " |"]
        out.append("|" + "---|" * (2 + len(cols)))
        tasks = sorted({r["task"] for r in rs})
        accs: dict = {}
        for t in tasks:
            cells = []
            n = None
            for c in cols:
                m = [r for r in rs if r["task"] == t and _column(r) == c]
                if m:
                    accs.setdefault(c, []).append(m[0]["accuracy"])
                    n = max(n or 0, m[0]["trials"])
                    part = f" ({m[0]['trials']}/{m[0].get('trials_planned')})" if m[0].get("partial") else ""
                    cells.append(_f(m[0]["accuracy"]) + part)
                else:
                    cells.append("-")
            out.append(f"| {t} | {n} | " + " | ".join(cells) + " |")
        overall = [_f(sum(accs[c]) / len(accs[c])) if c in accs else "-" for c in cols]
        out.append("| overall | | " + " | ".join(overall) + " |")
        depths = sorted({d for r in rs for d in r.get("per_depth", {})}, key=float)
        if depths:
            out += ["", "By depth (mean over tasks):", "", "| depth | " + " | ".join(names) + " |"]
            out.append("|" + "---|" * (1 + len(cols)))
            for dep in depths:
                cells = []
                for c in cols:
                    v = [
                        r["per_depth"][dep]
                        for r in rs
                        if (r["policy"], r.get("budget"), r.get("drafter")) == c
                        and dep in r.get("per_depth", {})
                    ]
                    cells.append(_f(sum(v) / len(v)) if v else "-")
                out.append(f"| {dep} | " + " | ".join(cells) + " |")
        out.append("")
    return out


# ------------------------------------------------------------------------------------------ plots
def plots(data: dict, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "oasis eval: matplotlib is not installed: plots skipped (re-render with "
            "`oasis eval --report-only --out DIR` where it is)",
            file=sys.stderr,
        )
        return []
    written: list[Path] = []
    teacher = _records(data, "teacher")
    oasis = [r for r in teacher if r.get("policy") == "oasis" and r.get("lookahead")]
    for ctx, tag, rs in _by_setting(oasis):
        budgets = sorted(_by(rs, "budget"), key=_budget_key)
        caps = sorted({r.get("fetch_cap") for r in rs}, key=_cap_key)
        fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False, sharey=True)
        for ax, bud in zip(axes[0], budgets, strict=True):
            for r in sorted(_by(rs, "budget")[bud], key=lambda r: _drafter_key(r["drafter"])):
                ys = r["lookahead"]["overlap_per_layer"]
                style = "-" if r.get("fetch_cap") == caps[0] else "--"
                ax.plot(
                    range(len(ys)),
                    [math.nan if y is None else y for y in ys],
                    style,
                    marker=".",
                    color=f"C{_drafter_key(r['drafter'])}",
                    label=f"{r['drafter']} cap={_cap(r.get('fetch_cap'))}",
                )
            ax.set_title(f"budget {bud} (K={_by(rs, 'budget')[bud][0].get('top_k_blocks')})")
            ax.set_xlabel("layer")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("overlap with exact next-query top-K")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"Lookahead accuracy per layer, context {ctx}")
        fig.tight_layout()
        written.append(_save(fig, out / f"lookahead_per_layer_{tag}.png", plt))

        fig, ax = plt.subplots(figsize=(8, 4))
        drafted = [r for r in rs if r.get("fetch_cap") == caps[0] and r["drafter"] != "previous-query"]
        labels = []
        for i, r in enumerate(
            sorted(drafted, key=lambda r: (_budget_key(r["budget"]), _drafter_key(r["drafter"])))
        ):
            la = r["lookahead"]
            for j, (k, c) in enumerate((("overlap_matched", "C2"), ("overlap_unmatched", "C3"))):
                v = la.get(k)
                ax.bar(
                    i + 0.4 * j - 0.2, v if v is not None else 0, 0.4, color=c, label=k if i == 0 else None
                )
            labels.append(f"{r['drafter']}\n{r['budget']}")
        prev = [r for r in rs if r["drafter"] == "previous-query" and r.get("fetch_cap") == caps[0]]
        for r in prev:
            ax.axhline(r["lookahead"]["overlap"], color="0.4", ls=":", lw=1)
        if prev:
            ax.text(
                0, prev[0]["lookahead"]["overlap"], " previous-query (per budget)", fontsize=7, va="bottom"
            )
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("overlap")
        ax.set_ylim(0, 1.02)
        ax.legend(["draft = next token", "draft != next token"], fontsize=8)
        ax.set_title(f"Overlap split by draft match, context {ctx}, cap {_cap(caps[0])}")
        fig.tight_layout()
        written.append(_save(fig, out / f"lookahead_matched_{tag}.png", plt))

    for ctx, tag, rs in _by_setting([r for r in teacher if r.get("policy") != "dense"]):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        budgets = sorted(_by(rs, "budget"), key=_budget_key)
        markers = {
            "eagle3": "o",
            "eagle3+current": "X",
            "eagle3-noprefill": "D",
            "eagle3-prefill": "P",
            "ngram": "s",
            "oracle": "*",
            "previous-query": "v",
        }
        for bi, bud in enumerate(budgets):
            for r in _by(rs, "budget")[bud]:
                if r["policy"] == "quest":
                    ax.axhline(r.get("delta_nll_pct", math.nan), color=f"C{bi}", ls=":", lw=1)
                    continue
                x = max(r.get("fetched_bytes_per_step") or 0.0, 1.0) / 1e6
                ax.scatter(
                    x,
                    r.get("delta_nll_pct", math.nan),
                    marker=markers.get(r["drafter"], "x"),
                    facecolors=f"C{bi}" if r.get("fetch_cap") is not None else "none",
                    edgecolors=f"C{bi}",
                    s=50,
                )
        from matplotlib.lines import Line2D

        handles = [
            Line2D([], [], color=f"C{i}", marker="o", ls="", label=f"budget {b}")
            for i, b in enumerate(budgets)
        ]
        handles += [
            Line2D([], [], color="k", marker=m, ls="", mfc="none", label=d)
            for d, m in markers.items()
            if any(r.get("drafter") == d for r in rs)
        ]
        handles += [Line2D([], [], color="k", ls=":", label="Quest-like (same budget)")]
        ax.legend(handles=handles, fontsize=7)
        xs = [r.get("fetched_bytes_per_step") or 0.0 for r in rs if r["policy"] == "oasis"]
        if xs and min(xs) > 0 and max(xs) / min(xs) > 20:
            ax.set_xscale("log")
        ax.set_xlabel("host-to-GPU KV fetched per step (MB, all layers); filled = capped")
        ax.set_ylabel("ΔNLL vs dense (%)")
        ax.set_title(f"Fidelity vs traffic, context {ctx}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, out / f"fidelity_vs_bytes_{tag}.png", plt))

    ret = _records(data, "retrieval")
    for ctx, rs in sorted(_by(ret, "context").items()):
        tasks = sorted({r["task"] for r in rs})
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.8), squeeze=False, sharey=True)
        for ax, t in zip(axes[0], tasks, strict=True):
            for r in sorted(
                [r for r in rs if r["task"] == t],
                key=lambda r: (r["policy"] != "dense", _budget_key(r.get("budget"))),
            ):
                pd = r.get("per_depth", {})
                ds = sorted(pd, key=float)
                name = "dense" if r["policy"] == "dense" else f"{r['policy']} {r.get('budget')}"
                ax.plot(
                    [float(d) for d in ds],
                    [pd[d] for d in ds],
                    marker="o",
                    label=name,
                    ls="-" if r["policy"] != "quest" else ":",
                    lw=2.5 if r["policy"] == "dense" else 1.2,
                )
            ax.set_title(f"{t}")
            ax.set_xlabel("depth")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("accuracy")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"Retrieval, context {ctx}")
        fig.tight_layout()
        written.append(_save(fig, out / f"retrieval_C{ctx}.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out: Path) -> list[Path]:
    """Write results.md and the plots from ``out/results.json``; returns the paths written."""
    out = Path(out)
    path = out / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `oasis eval --out {out}` first")
    data = json.loads(path.read_text(encoding="utf-8"))
    md = out / "results.md"
    md.write_text(render_markdown(data), encoding="utf-8")
    pngs = plots(data, out)
    names = "\n".join(f"![{p.stem}]({p.name})" for p in pngs)
    if names:
        with md.open("a", encoding="utf-8") as f:
            f.write("\n## Plots\n\n" + names + "\n")
    return [path, md, *pngs]
