#!/usr/bin/env python
"""F.linear vs W @ x^T vs the oneDNN-packed weight for a few rows on one CPU core
(the three forms sglang_ssd/cpu/small_m_linear.py measures).

The target's own shapes (hidden, intermediate, layers, vocabulary from its config.json), float32, one
thread: per row count M, the median time of all layers' projections (qkv, o, gate_up, down) and of the
tied lm head, each form.  -> results/<out>.{json,md} (default small_m_linear)

    taskset -c 0 python scripts/bench_small_m.py [--rows 1 2 3 4 6 8 12 16 32] [--iters 10] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from sglang_ssd import paths  # noqa: E402

sys.path.insert(0, str(HERE))
from bench_verify import cpu_name  # noqa: E402

from sglang_ssd.cpu import small_m_linear as sm  # noqa: E402

log = logging.getLogger("bench_small_m")
OUT = HERE.parent / "results" / "small_m_linear"


def median_ms(f, iters: int) -> float:
    f()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="small_m_linear", help="results/<out>.{json,md}")
    args = ap.parse_args()
    out = OUT.with_name(args.out)
    if not sm.packed_available():
        raise SystemExit("this torch has no oneDNN linear (torch.ops.mkldnn._reorder_linear_weight)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    cfg = json.load(open(Path(paths.target_path()) / "config.json"))
    h, i, n_layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"])) * hd
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(qkv, h, generator=g), torch.randn(h, h, generator=g), torch.randn(2 * i, h, generator=g),
               torch.randn(h, i, generator=g)) for _ in range(n_layers)]  # distinct weights: none stays in cache
    head = torch.randn(v, h, generator=g)
    for w in [*(w for ws in layers for w in ws), head]:
        sm.packed_weight(w)  # packed once up front, as the route keeps it
    rows = []
    for m in args.rows:
        x, xi = torch.randn(m, h, generator=g), torch.randn(m, i, generator=g)

        def lin():
            for a, b, c, d in layers:
                F.linear(x, a), F.linear(x, b), F.linear(x, c), F.linear(xi, d)

        def wx():
            for a, b, c, d in layers:
                torch.mm(a, x.t()), torch.mm(b, x.t()), torch.mm(c, x.t()), torch.mm(d, xi.t())

        def pk():
            for a, b, c, d in layers:
                sm.packed(x, a), sm.packed(x, b), sm.packed(x, c), sm.packed(xi, d)

        r = {"rows": m, "layers_linear_ms": median_ms(lin, args.iters), "layers_wxt_ms": median_ms(wx, args.iters),
             "layers_packed_ms": median_ms(pk, args.iters),
             "head_linear_ms": median_ms(lambda: F.linear(x, head), args.iters),
             "head_wxt_ms": median_ms(lambda: torch.mm(head, x.t()).t().contiguous(), args.iters),
             "head_packed_ms": median_ms(lambda: sm.packed(x, head), args.iters)}
        r = {k: round(val, 2) if isinstance(val, float) else val for k, val in r.items()}
        log.info("%s", r)
        rows.append(r)
    res = {"cpu": cpu_name(), "torch": torch.__version__, "threads": 1, "dtype": "float32",
           "shapes": {"hidden": h, "intermediate": i, "layers": n_layers, "vocab": v, "qkv": qkv}, "rows": rows}
    out.parent.mkdir(exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    base = next((r for r in rows if r["rows"] == 1), rows[0])
    L = ["# F.linear vs W @ x^T vs packed weight for a few rows (CPU, one core)", "",
         f"CPU: {res['cpu']}; torch {res['torch']}, float32, one thread; the target's shapes ({n_layers} layers, "
         f"hidden {h}, intermediate {i}, qkv {qkv}, vocabulary {v}); medians of {args.iters} calls "
         "(scripts/bench_small_m.py). The forms sglang_ssd/cpu/small_m_linear.py measures for 2 <= M <= 32; "
         "packed = the weight reordered once into oneDNN's blocked layout.", "",
         "| rows M | layers F.linear ms | layers W @ x^T ms | layers packed ms | head F.linear ms | head W @ x^T ms | "
         "head packed ms | (layers + head) / M = 1 F.linear: F.linear | W @ x^T | packed |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    one = base["layers_linear_ms"] + base["head_linear_ms"]
    for r in rows:
        tot = {f: (r[f"layers_{f}_ms"] + r[f"head_{f}_ms"]) / one for f in ("linear", "wxt", "packed")}
        L.append(f"| {r['rows']} | {r['layers_linear_ms']} | {r['layers_wxt_ms']} | {r['layers_packed_ms']} | "
                 f"{r['head_linear_ms']} | {r['head_wxt_ms']} | {r['head_packed_ms']} | {tot['linear']:.2f} | "
                 f"{tot['wxt']:.2f} | {tot['packed']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
