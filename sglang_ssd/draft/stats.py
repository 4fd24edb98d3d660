"""Print what a running draft process has learned: hit rates, the live fan-out fit, the backup choice.

    python -m sglang_ssd.draft.stats ENDPOINT [--json] [--curve-keys DIR]

ENDPOINT is the draft's ZeroMQ address (SGLANG_SSD_CONFIG draft_endpoint, or the ipc:// path in the
server log).  With fan_out_auto the fitted acceptance a and miss exponent r per source (primary = the
speculation came from the cache, backup = it did not), the current schedules F^p / F^b and the
predicted vs measured hit rates are shown.
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_ssd.draft.client import DraftClient


def format_health(h: dict) -> str:
    cuts = ", ".join(f"{d}: {n}" for d, n in sorted((int(k[len("cut_depth_"):]), int(v)) for k, v in h.items()
                                                    if k.startswith("cut_depth_")))
    lines = [f"rounds {int(h.get('rounds', 0))}, rows {int(h.get('rows', 0))}, hit rate {h.get('hit_rate', 0):.3f} "
             f"({int(h.get('hits', 0))} hits, {int(h.get('misses', 0))} misses), live requests "
             f"{int(h.get('live_requests', 0))}",
             f"backup rows: neural {int(h.get('neural_backup_rows', 0))}, fast {int(h.get('fast_backup_rows', 0))}"
             f" (current choice {'fast' if h.get('backup_fast_now') else 'neural'}); avg build "
             f"{h.get('avg_build_ms', 0):.1f} ms, avg backup {h.get('avg_backup_ms', 0):.1f} ms",
             f"cache builds {int(h.get('builds', 0))}, cut short by a waiting message {int(h.get('builds_cut', 0))} "
             f"(after depth: {cuts or 'none'})"]
    if "fanout_observations" in h:
        lines.append(f"fan-out fit from {int(h['fanout_observations'])} verified rows:")
        for src in ("primary", "backup"):
            fan = [int(h[f"fanout_{src}_F{j}"]) for j in range(int(h.get("k", 0)) + 1) if f"fanout_{src}_F{j}" in h]
            meas = h[f"fanout_{src}_measured_hit"]
            lines.append(f"  {src:7s} a = {h[f'fanout_{src}_a']:.3f}  r = {h[f'fanout_{src}_r']:.3f}  F = {fan}  "
                         f"hit rate predicted {h[f'fanout_{src}_predicted_hit']:.3f}, measured "
                         f"{'n/a' if meas < 0 else f'{meas:.3f}'}")
    else:
        lines.append("fan-out: fixed (SGLANG_SSD_CONFIG fan_out_auto is false)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("endpoint")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--curve-keys", default=None, metavar="DIR",
                    help="CurveZMQ key directory (a draft on another host)")
    args = ap.parse_args(argv)
    with DraftClient(args.endpoint, timeout_s=args.timeout, curve_keys=args.curve_keys) as client:
        h = client.health()
    print(json.dumps(h, indent=1) if args.json else format_health(h))
    return 0


if __name__ == "__main__":
    sys.exit(main())
