#!/usr/bin/env python
"""The README's headline: AR vs SD vs SSD by batch size and temperature, from scripts/bench_variants.py runs.

Reads one or more results/variants_*.json (each a run where all modes' servers were up side by side), takes
the variants named --ar / --sd / --ssd in each (T, b) cell, and writes results/headline.{md,json} and
results/headline_{tokps,speedup}.png: tok/s (medians over repeats), SSD/SD and SSD/AR (medians of per-repeat
ratios: same prompts), the K each server ran, the draft wait as a share of the round, the round split
(ms: draft wait, verify, acceptance, worker, scheduler) and the paper's Theorem 7 prediction of SSD/AR from the
measured inputs:

    SSD/AR ~= [p E_hit + (1 - p) E_miss] / [p max(1, T_p) + (1 - p)(1 + T_b)] * t_AR / t_verify

p = hit rate, E_hit / E_miss = tokens per round of hit / missed rows, T_p = cache build / verify, T_b = backup
draft time per missed row / verify (both relative to the verify, the paper's unit), t_AR = one AR decode step
at that batch size (b / AR tok/s), t_verify the measured verify forward.  What it leaves out (draft wait beyond
the build, acceptance, the scheduler between rounds) is the gap to the measured ratio.

    python scripts/headline.py results/variants_kchoice.json results/variants_batch_auto.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
SPLIT = ("wait_ms", "verify_ms", "accept_ms", "worker_other_ms", "sched_gap_ms")


def _med(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def cells(paths: list[Path], names: dict[str, str]) -> dict:
    """(T, b) -> mode -> list of per-repeat cells, and the machine line of the first run."""
    out, machine = {}, None
    for p in paths:
        state = json.loads(p.read_text())
        machine = machine or state["machine"]
        for c in state["cells"].values():
            for mode, name in names.items():
                if c["variant"] == name:
                    out.setdefault((c["temperature"], c["batch"]), {}).setdefault(mode, []).append(c)
    return out, machine


def ratio(num: list, den: list):
    d = {c["rep"]: c["tok_s"] for c in den}
    return _med([c["tok_s"] / d[c["rep"]] for c in num if c["rep"] in d])


def theorem7(ssd: list, ar: list, b: int):
    """The paper's SSD/AR from this cell's measured medians (see the module docstring)."""
    m = {k: _med([c.get(k) for c in ssd]) for k in ("hit_rate", "e_hit", "e_miss", "verify_ms", "build_ms",
                                                   "draft_backup_ms", "backup_frac")}
    ar_tok = _med([c["tok_s"] for c in ar])
    if any(v is None for v in m.values()) or not ar_tok or not m["verify_ms"]:
        return None
    p, tv = m["hit_rate"], m["verify_ms"]
    t_p = m["build_ms"] / tv
    t_b = (m["draft_backup_ms"] / max(1e-9, 1 - p)) / tv if p < 1 else 0.0  # per missed row's round
    speed = (p * m["e_hit"] + (1 - p) * m["e_miss"]) / (p * max(1.0, t_p) + (1 - p) * (1 + t_b))
    return speed * (1000.0 * b / ar_tok) / tv


def summarize(by_cell: dict) -> list[dict]:
    rows = []
    for (t, b), modes in sorted(by_cell.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if not {"ar", "sd", "ssd"} <= set(modes):
            continue
        r = {"T": t, "b": b, "repeats": len(modes["ssd"])}
        for mode in ("ar", "sd", "ssd"):
            r[f"{mode}_tok_s"] = _med([c["tok_s"] for c in modes[mode]])
        for mode in ("sd", "ssd"):
            r[f"{mode}_k"] = _med([c.get("k") for c in modes[mode]])
            r[f"{mode}_accept_len"] = _med([c.get("accept_len") for c in modes[mode]])
            r[f"{mode}_split_ms"] = {k: _med([c.get(k) for c in modes[mode]]) for k in SPLIT}
            total = sum(v for v in r[f"{mode}_split_ms"].values() if v is not None)
            r[f"{mode}_round_ms"] = total
            r[f"{mode}_wait_frac"] = r[f"{mode}_split_ms"]["wait_ms"] / total if total else None
        r["ssd_hit_rate"] = _med([c.get("hit_rate") for c in modes["ssd"]])
        r["ssd_sd"], r["ssd_ar"], r["sd_ar"] = (ratio(modes["ssd"], modes["sd"]), ratio(modes["ssd"], modes["ar"]),
                                                ratio(modes["sd"], modes["ar"]))
        r["ssd_ar_theorem7"] = theorem7(modes["ssd"], modes["ar"], b)
        r["resets"] = sum(c.get("resets") or 0 for m in ("sd", "ssd") for c in modes[m])
        r["deadline_misses"] = sum(c.get("deadline_misses") or 0 for m in ("sd", "ssd") for c in modes[m])
        rows.append(r)
    return rows


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def markdown(rows: list[dict], machine: dict, sources: list[str]) -> str:
    L = ["# Headline: AR vs SD vs SSD (CPU miniature)", "",
         f"{machine['cpu']}, {machine['cores']} cores; torch {machine['torch']}, SGLang {machine['sglang']}; target on "
         "core 0, draft on core 1; SmolLM2-135M-Instruct fp32 target, the default trained draft; 64 tokens per "
         "request (EOS ignored); K per server in the K column (a run's variants either name K or 'auto': no "
         "--speculative-num-steps, measured at launch); "
         "medians over repeats, ratios = medians of per-repeat ratios on the same prompts. From "
         + ", ".join(f"`{s}`" for s in sources) + " (scripts/headline.py).", "",
         "| T | b | AR tok/s | SD tok/s | SSD tok/s | K (SD/SSD) | SSD/SD | SSD/AR | SD/AR | SSD/AR by Thm 7 | "
         "SSD accept len | SSD hit rate | draft wait, % of round (SD / SSD) | resets / deadline misses |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['T']:g} | {r['b']} | {_f(r['ar_tok_s'])} | {_f(r['sd_tok_s'])} | {_f(r['ssd_tok_s'])} | "
                 f"{_f(r['sd_k'], '{:g}')}/{_f(r['ssd_k'], '{:g}')} | **{_f(r['ssd_sd'])}** | **{_f(r['ssd_ar'])}** | "
                 f"{_f(r['sd_ar'])} | {_f(r['ssd_ar_theorem7'])} | {_f(r['ssd_accept_len'])} | "
                 f"{_f(r['ssd_hit_rate'])} | {_f(r['sd_wait_frac'], '{:.1%}')} / {_f(r['ssd_wait_frac'], '{:.1%}')} | "
                 f"{r['resets']} / {r['deadline_misses']} |")
    L += ["", "Where the time goes (ms per round: draft wait + verify + acceptance + worker + scheduler = round; "
          "tokens per round = accept length; AR = ms per decode step):", "",
          "| T | b | AR step | SD round | SD tokens | SSD round | SSD tokens |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = {m: " + ".join(_f(r[f"{m}_split_ms"][k], "{:.1f}") for k in SPLIT) for m in ("sd", "ssd")}
        L.append(f"| {r['T']:g} | {r['b']} | {_f(1000 * r['b'] / r['ar_tok_s'], '{:.1f}')} | {parts['sd']} = "
                 f"{_f(r['sd_round_ms'], '{:.1f}')} | {_f(r['sd_accept_len'])} | {parts['ssd']} = "
                 f"{_f(r['ssd_round_ms'], '{:.1f}')} | {_f(r['ssd_accept_len'])} |")
    return "\n".join(L) + "\n"


def plots(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["T"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    for ax, t in zip(axes[0], temps):
        rs = [r for r in rows if r["T"] == t]
        xs = range(len(rs))
        for i, (mode, name) in enumerate((("ar", "AR"), ("sd", "SD"), ("ssd", "SSD"))):
            ax.bar([x + (i - 1) * 0.27 for x in xs], [r[f"{mode}_tok_s"] for r in rs], 0.27, label=name)
        ax.set_xticks(list(xs), [f"b={r['b']}" for r in rs])
        ax.set_title(f"T = {t:g}")
        ax.set_ylabel("output tok/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "_tokps.png"), dpi=110)
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    for ax, t in zip(axes[0], temps):
        rs = [r for r in rows if r["T"] == t]
        bs = [r["b"] for r in rs]
        ax.plot(bs, [r["ssd_ar"] for r in rs], "o-", label="SSD/AR")
        ax.plot(bs, [r["ssd_sd"] for r in rs], "s-", label="SSD/SD")
        ax.plot(bs, [r["sd_ar"] for r in rs], "^--", label="SD/AR")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("batch size b")
        ax.set_title(f"T = {t:g}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "_speedup.png"), dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--ar", default="ar")
    ap.add_argument("--sd", default="sd-auto")
    ap.add_argument("--ssd", default="ssd-auto")
    ap.add_argument("--out", type=Path, default=RESULTS / "headline")
    args = ap.parse_args(argv)
    by_cell, machine = cells(args.runs, {"ar": args.ar, "sd": args.sd, "ssd": args.ssd})
    rows = summarize(by_cell)
    if not rows:
        print("no (T, b) cell has all three modes", file=sys.stderr)
        return 1
    sources = [str(p.relative_to(RESULTS.parent)) if p.is_absolute() and RESULTS.parent in p.parents else str(p)
               for p in args.runs]
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "sources": sources, "rows": rows},
                                                         indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, machine, sources))
    plots(rows, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
