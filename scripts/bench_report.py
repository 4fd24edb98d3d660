"""Tables and plots for scripts/bench_cpu.py: results/cpu_bench.md and results/cpu_bench_*.png.

Every number is a median over the repeats of a cell, with [min-max]; ratios (SSD/SD, SSD/AR, SD/AR) are
medians of the per-repeat ratios (same prompts, same T and b, same invocation), so they pair like with like.

    python scripts/bench_report.py   # rewrite the report from results/cpu_bench.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "results" / "cpu_bench"
MODES = ("ar", "sd", "ssd")
NAMES = {"ar": "AR", "sd": "SD", "ssd": "SSD"}
METRICS = ("tok_s", "tpot_ms", "accept_len", "hit_rate", "waited_frac", "backup_frac", "wait_ms", "verify_ms",
           "accept_ms", "worker_other_ms", "sched_gap_ms", "build_ms", "draft_answer_ms", "draft_backup_ms")


def aggregate(state: dict, context: bool = False) -> dict[tuple, dict]:
    """(mode, k, T, b) -> {metric: (median, min, max)}, plus 'runs' (per-repeat dicts by rep); with
    context=True the context-length cells (tier 4) instead, keyed (mode, k, T, context)."""
    groups: dict[tuple, list] = {}
    for c in state["cells"].values():
        if bool(c.get("context")) != context:
            continue
        last = c["context"] if context else c["batch"]
        groups.setdefault((c["mode"], c["k"], c["temperature"], last), []).append(c)
    agg = {}
    for key, runs in groups.items():
        a = {"n": len(runs), "runs": {r["rep"]: r for r in runs}}
        for m in METRICS:
            vals = [r[m] for r in runs if m in r]
            if vals:
                a[m] = (statistics.median(vals), min(vals), max(vals))
        agg[key] = a
    return agg


def ratio(agg: dict, num: tuple, den: tuple):
    """Median [min-max] over repeats of tok/s(num) / tok/s(den), pairing equal repeat indices."""
    if num not in agg or den not in agg:
        return None
    a, b = agg[num]["runs"], agg[den]["runs"]
    vals = [a[r]["tok_s"] / b[r]["tok_s"] for r in a if r in b]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def _fmt(v, digits=2) -> str:
    if v is None:
        return "-"
    med, lo, hi = v
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def _key(mode: str, k: int, t: float, b: int) -> tuple:
    return (mode, 0 if mode == "ar" else k, t, b)


def headline(agg: dict, k: int = 3, b: int = 1) -> list[str]:
    L = [f"| T | AR tok/s | SD tok/s | SSD tok/s | SSD/SD | SSD/AR | SD/AR | SSD accept len | SSD hit rate |",
         "|---|---|---|---|---|---|---|---|---|"]
    for t in (0.0, 1.0):
        ar, sd, ssd = (_key(m, k, t, b) for m in MODES)
        g = lambda key, m: _fmt(agg[key].get(m)) if key in agg else "-"  # noqa: E731
        L.append(f"| {t:g} | {g(ar, 'tok_s')} | {g(sd, 'tok_s')} | {g(ssd, 'tok_s')} | {_fmt(ratio(agg, ssd, sd))} | "
                 f"{_fmt(ratio(agg, ssd, ar))} | {_fmt(ratio(agg, sd, ar))} | {g(ssd, 'accept_len')} | "
                 f"{g(ssd, 'hit_rate')} |")
    return L


def full_table(agg: dict) -> list[str]:
    L = ["| mode | K | T | b | tok/s | TPOT ms | accept len | hit rate | target waited | backup rows | runs |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, k, t, b) in sorted(agg, key=lambda x: (x[3], x[2], MODES.index(x[0]), x[1])):
        a = agg[(mode, k, t, b)]
        L.append(f"| {NAMES[mode]} | {k or '-'} | {t:g} | {b} | {_fmt(a.get('tok_s'))} | {_fmt(a.get('tpot_ms'), 0)} | "
                 f"{_fmt(a.get('accept_len'))} | {_fmt(a.get('hit_rate'))} | {_fmt(a.get('waited_frac'))} | "
                 f"{_fmt(a.get('backup_frac'))} | {a['n']} |")
    return L


def time_split(agg: dict) -> list[str]:
    """Where a decode round's time goes (ms per round, medians) and what that costs per output token."""
    L = ["| mode | K | T | b | draft wait | (draft answering / backup) | target verify | acceptance | worker rest | "
         "scheduler | round total | tokens/round/request | ms/token (b=1) | draft cache build | "
         "verify vs SD (interference) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, k, t, b), a in sorted(agg.items(), key=lambda x: (x[0][3], x[0][2], x[0][1], x[0][0])):
        if mode == "ar" or "verify_ms" not in a or b not in (1, 4):
            continue
        parts = [a[m][0] for m in ("wait_ms", "verify_ms", "accept_ms", "worker_other_ms", "sched_gap_ms")]
        total = sum(parts)
        per_tok = f"{total / a['accept_len'][0]:.1f}" if b == 1 else "-"
        ans = (f"{a['draft_answer_ms'][0]:.1f} / {a['draft_backup_ms'][0]:.1f}" if "draft_answer_ms" in a else "-")
        cells = [f"{parts[0]:.1f}", ans] + [f"{x:.1f}" for x in parts[1:]]
        sd = agg.get(("sd", k, t, b), {})
        # the target's verify forward while the draft builds (SSD) over the same forward with the
        # draft idle (SD waits for the draft before verifying): > 1 = the draft slows the target's core
        inter = f"{a['verify_ms'][0] / sd['verify_ms'][0]:.2f}" if mode == "ssd" and "verify_ms" in sd else "-"
        L.append(f"| {NAMES[mode]} | {k} | {t:g} | {b} | " + " | ".join(cells) +
                 f" | {total:.1f} | {a['accept_len'][0]:.2f} | {per_tok} | {a['build_ms'][0]:.1f} | {inter} |")
    for t in (0.0, 1.0):
        if _key("ar", 0, t, 1) in agg:
            L.append(f"| AR | - | {t:g} | 1 | - | - | - | - | - | - | - | 1 | "
                     f"{1000 / agg[_key('ar', 0, t, 1)]['tok_s'][0]:.1f} | - | - |")
    return L


def context_table(agg_ctx: dict, k: int = 3) -> list[str]:
    """Tier 4: b = 1 by prompt length; SSD/AR at the longest vs the shortest prompt (target >= 0.9)."""
    ctxs = sorted({key[3] for key in agg_ctx})
    if not ctxs:
        return []
    L = ["| T | prompt tokens | AR tok/s | SD tok/s | SSD tok/s | SSD/AR | SSD/SD | SSD verify ms | SSD accept len |",
         "|---|---|---|---|---|---|---|---|---|"]
    for t in (0.0, 1.0):
        for ctx in ctxs:
            ar, sd, ssd = ((m, 0 if m == "ar" else k, t, ctx) for m in MODES)
            g = lambda key, m: _fmt(agg_ctx[key].get(m)) if key in agg_ctx else "-"  # noqa: E731
            L.append(f"| {t:g} | {ctx} | {g(ar, 'tok_s')} | {g(sd, 'tok_s')} | {g(ssd, 'tok_s')} | "
                     f"{_fmt(ratio(agg_ctx, ssd, ar))} | {_fmt(ratio(agg_ctx, ssd, sd))} | {g(ssd, 'verify_ms')} | "
                     f"{g(ssd, 'accept_len')} |")
        lo, hi = (ratio(agg_ctx, ("ssd", k, t, c), ("ar", 0, t, c)) for c in (ctxs[0], ctxs[-1]))
        if lo and hi:
            L.append(f"| {t:g} | {ctxs[-1]} vs {ctxs[0]} | | | | {hi[0] / lo[0]:.2f} (target >= 0.9) | | | |")
    return L


def plots(agg: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(ax, pts, label):
        """One median line with min-max error bars; pts = [(x, (median, min, max)), ...]."""
        pts = [(x, v) for x, v in pts if v]
        if pts:
            ax.errorbar([x for x, _ in pts], [v[0] for _, v in pts], capsize=3, marker="o", label=label,
                        yerr=[[v[0] - v[1] for _, v in pts], [v[2] - v[0] for _, v in pts]])

    def by_batch(name, ylabel, draw):
        """Two panels (T = 0, T = 1) over batch size at K = 3; draw(ax, t) adds the series."""
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, t in zip(axes, (0.0, 1.0)):
            draw(ax, t)
            ax.set(title=f"T = {t:g} (K = 3)", xlabel="batch size", xscale="log", xticks=batches,
                   xticklabels=[str(b) for b in batches])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(ylabel)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(out.parent / f"{out.name}_{name}.png", dpi=110)
        made.append(f"{out.name}_{name}.png")

    made = []
    batches = sorted({key[3] for key in agg})

    def tokps(ax, t):
        for mode in MODES:
            series(ax, [(b, agg.get(_key(mode, 3, t, b), {}).get("tok_s")) for b in batches], NAMES[mode])

    def speedup(ax, t):
        for num, den in (("ssd", "sd"), ("ssd", "ar"), ("sd", "ar")):
            series(ax, [(b, ratio(agg, _key(num, 3, t, b), _key(den, 3, t, b))) for b in batches],
                   f"{NAMES[num]}/{NAMES[den]}")
        ax.axhline(1.0, color="gray", lw=0.8)

    by_batch("tokps", "decode tokens/s", tokps)
    by_batch("speedup", "speedup (tokens/s ratio)", speedup)

    ks = sorted({key[1] for key in agg if key[0] == "ssd"})
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for t in (0.0, 1.0):
        for b in sorted({key[3] for key in agg if key[0] == "ssd"}):
            pts = [(k, agg[("ssd", k, t, b)]["hit_rate"]) for k in ks if ("ssd", k, t, b) in agg]
            if len(pts) > 1:
                series(ax, pts, f"T={t:g} b={b}")
    ax.set(title="SSD cache hit rate vs K", xlabel="K (speculated tokens)", ylabel="hit rate", xticks=ks)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # K sweep (tier 3) measured
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.parent / f"{out.name}_hit_vs_k.png", dpi=110)
    made.append(f"{out.name}_hit_vs_k.png")
    plt.close("all")
    return made


def write_report(state: dict, out: Path = OUT) -> None:
    agg = aggregate(state)
    fp, m, cfg = state["fingerprint"], state.get("machine", {}), state.get("config", {})
    L = ["# AR vs SD vs SSD on the CPU miniature (issue 6)", "",
         f"SGLang {m.get('sglang')} on CPU ({m.get('cpu')}, {m.get('cores')} cores), torch {m.get('torch')}, fp32. "
         f"Target SmolLM2-135M-Instruct pinned to core 0; draft = {cfg.get('draft')}; SD = saguaro sync mode, "
         f"SSD = saguaro async mode (fan-out {fp['fan_out']} per depth), AR = plain SGLang. "
         f"{fp['tokens']} output tokens per request (EOS ignored); batch size b = concurrent requests. "
         f"Prompts scripts/prompts_bench.json (sha256 {fp['prompts_sha256']}); target {fp['target_sha256']}, "
         f"draft {fp['draft_sha256']}. Each cell: median [min-max] over {state.get('repeats')} repeats, each "
         f"4 requests at b = 1 (2 for K = 4, 5: alternating halves of the K = 3 cell's, a recorded subset), b at b > 1 (scripts/bench_cpu.py, {len(state['cells'])} cell runs).", "",
         "## Headline: b = 1, K = 3", ""] + headline(agg) + [""]
    try:
        made = plots(agg, out)
        L += ["![tokens/s](" + made[0] + ") ![speedup](" + made[1] + ") ![hit rate vs K](" + made[2] + ")", ""]
    except ImportError:  # matplotlib missing: tables only
        pass
    L += ["## All cells", ""] + full_table(agg) + [
        "", "'target waited': fraction of rounds whose draft reply took > 5 ms (computed while the target "
        "waited; SD waits every round by design). 'backup rows': fraction of rows served by the backup "
        "speculator (cache misses).", "",
        "## Where a round's time goes (ms per decode round, medians)", ""] + time_split(agg) + [
        "", "draft wait: worker blocked on the draft's reply; target verify: the target's forward over the "
        "K+1-token chains (the linear chain verify on CPU, sglang_ssd/cpu/chain_attention.py); acceptance: target probabilities + exact acceptance; "
        "worker rest: bookkeeping in our worker; scheduler: SGLang's scheduler between two decode rounds "
        "(batch bookkeeping, output processing); draft cache build: the draft's per-round work in SSD "
        "(off the critical path when it fits inside the verify)."]
    ctx = context_table(aggregate(state, context=True))
    if ctx:
        L += ["", "## Context length (tier 4): b = 1, K = 3, a benchmark prompt after a real-text document", ""] + ctx
    out.with_suffix(".md").write_text("\n".join(L) + "\n")


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    write_report(json.loads(path.with_suffix(".json").read_text()), path)
