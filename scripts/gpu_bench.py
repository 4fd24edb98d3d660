"""AR / SD / SSD on one or two GPUs with the synthetic pair (scripts/make_synthetic_pair.py).

Part of scripts/gpu_check.sh; writes results/gpu_check.json and results/gpu_check.md.  The servers,
their flags and their time budgets come from scripts/gpu_plan.py (server_plan): AR (plain SGLang),
saguaro sync (SD) and async (SSD) with the equal draft (acceptance ~1) and the noisy draft
(acceptance < 1), and SSD with the noisy draft on the flashinfer and triton attention backends
(the custom-mask verify path; the default on H200 is fa3).  The target runs on cuda:0; the draft
on cuda:1 when there is a second GPU, else on cuda:0 too -- then target and draft compete for one
GPU and the SSD numbers are a LOWER BOUND (the results say so).  Each cell: b concurrent requests
of 64 random prompt tokens, 128 new tokens each (ignore_eos, T = 0), one timed wave after a
warm-up request.  A server over its budget is stopped and its remaining cells recorded as such.

SIGTERM / SIGINT (e.g. gpu_check.sh's `timeout`) raise SystemExit, so the server being measured
is stopped (its whole process group: SGLang's processes and the draft) before this process exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_plan import server_plan  # noqa: E402
from sglang_ssd.serving import SGLangServer  # noqa: E402

logger = logging.getLogger("gpu_bench")
PROMPT, NEW = 64, 128


class OverBudget(BaseException):
    """A server used up its time budget (start + warm-up + cells).  A BaseException, so that no
    library's `except Exception` on the way (requests, urllib3) swallows it."""


_state = {"stopping": False, "term": None}


def _on_term(signum, frame):
    """SIGTERM/SIGINT: unwind through the `finally` that stops the current server.  A signal that
    arrives while a server is being stopped is remembered and acted on once the stop is done."""
    logger.warning("%s: stopping the servers and exiting", signal.Signals(signum).name)
    _state["term"] = signum
    if not _state["stopping"]:
        raise SystemExit(128 + signum)


def _on_alarm(signum, frame):
    if not _state["stopping"]:
        raise OverBudget()


def install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    signal.signal(signal.SIGALRM, _on_alarm)


def run_cell(srv: SGLangServer, b: int, vocab: int, seed: int, timeout: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (PROMPT,), generator=g).tolist() for _ in range(b)]
    sp = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
    ex = ThreadPoolExecutor(b)
    try:  # no `with`: on a signal its exit would wait for requests that only the server's stop ends
        t0 = time.perf_counter()
        outs = list(ex.map(lambda p: srv.generate(input_ids=p, sampling_params=sp, timeout=timeout), prompts))
        wall = time.perf_counter() - t0
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    toks = sum(len(o.get("output_ids", [])) for o in outs)
    acc = [o["meta_info"].get("spec_accept_length") for o in outs if o["meta_info"].get("spec_accept_length")]
    return {"tok_s": toks / wall, "wall_s": wall, "tokens": toks,
            "accept_len": sum(acc) / len(acc) if acc else None,
            "first_ids": outs[0].get("output_ids", [])[:16]}


def _base(entry: dict) -> dict:
    return {"name": entry["name"], "mode": entry["label"], "draft": entry["draft"],
            "backend": entry["backend"] or "default"}


def serve(entry: dict, vocab: int, log: str, rows: list) -> None:
    """Start one planned server, measure its cells within its budget into ``rows``, stop it (always)."""
    base, t0 = _base(entry), time.monotonic()
    left = lambda: max(1.0, entry["budget_s"] - (time.monotonic() - t0))
    srv = SGLangServer(entry["model"], entry["args"], env=entry["env"], startup_timeout=entry["budget_s"],
                       log_path=log)
    try:
        signal.alarm(entry["budget_s"])
        try:
            srv.start()
            srv.generate(input_ids=list(range(10, 26)), sampling_params={"max_new_tokens": 8}, timeout=left())
            for b in entry["batch_sizes"]:
                cell = run_cell(srv, b, vocab, seed=b, timeout=left())
                rows.append({**base, "b": b, **cell})
                logger.info("%s b=%d: %.1f tok/s accept_len %s", entry["name"], b, cell["tok_s"], cell["accept_len"])
        finally:
            signal.alarm(0)  # disarmed before the handlers below run: no OverBudget can escape them
    except OverBudget:
        logger.error("%s: over its %d s budget, stopped (log %s)", entry["name"], entry["budget_s"], log)
        rows += _missing(entry, rows, {"error": f"over its {entry['budget_s']} s budget", "log": log})
    except Exception as exc:  # one failing server must not hide the others' numbers
        logger.error("%s failed: %s (log %s)", entry["name"], exc, log)
        rows += _missing(entry, rows, {"error": f"{type(exc).__name__}: {exc}", "log": log})
    finally:
        _state["stopping"] = True
        try:
            srv.stop()
        finally:
            _state["stopping"] = False
        if _state["term"] is not None:
            raise SystemExit(128 + _state["term"])


def _missing(entry: dict, rows: list, why: dict) -> list[dict]:
    done = {r["b"] for r in rows if r["name"] == entry["name"]}
    return [{**_base(entry), "b": b, **why} for b in entry["batch_sizes"] if b not in done]


def write_results(args, rows: list, n_gpu: int, t_start: float) -> None:
    """results/gpu_check.{json,md}; rewritten after every server so a cut-off run keeps what it measured."""
    ar = {r["b"]: r for r in rows if r["mode"] == "AR" and "tok_s" in r}
    for r in rows:
        if "tok_s" in r and r["b"] in ar:
            r["vs_ar"] = r["tok_s"] / ar[r["b"]]["tok_s"]
            # greedy exactness, first request's first 16 tokens (bf16 batch numerics may differ)
            r["same_as_ar"] = r["first_ids"] == ar[r["b"]]["first_ids"]
    shared = n_gpu < 2
    note = ("target and draft SHARE one GPU (cuda:0): SSD numbers are a lower bound" if shared
            else "target on cuda:0, draft on cuda:1")
    env = json.load(open(args.env_json)) if args.env_json and os.path.exists(args.env_json) else None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    res = {"device": device, "gpus": n_gpu, "shared_gpu": shared, "note": note, "k": args.k,
           "prompt_tokens": PROMPT, "new_tokens": NEW, "pytest_rc": args.pytest_rc,
           "pytest_summary": args.pytest_summary, "elapsed_s": time.monotonic() - t_start, "env": env, "rows": rows}
    with open(os.path.join(args.out, "gpu_check.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    lines = [f"# GPU check ({device} x {n_gpu})", "", f"- {note}",
             f"- GPU tests: rc={args.pytest_rc} {args.pytest_summary}"]
    if env:
        lines.append(f"- flashinfer kernels: {env['flashinfer_kernels']}; nvcc {env['nvcc']['nvcc'] or 'not found'}"
                     f"; flashinfer-jit-cache {env['packages'].get('flashinfer-jit-cache') or 'no'}, "
                     f"flashinfer-cubin {env['packages'].get('flashinfer-cubin') or 'no'}")
    lines += [f"- synthetic Llama pair, K={args.k}, {PROMPT} prompt + {NEW} new tokens, T=0, one wave per cell; "
              "'same tokens as AR' compares with AR on the default backend (another backend's bf16 numerics "
              "may differ)", "",
              "| server | mode | draft | backend | b | tok/s | vs AR | accept len | same tokens as AR | note |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: f.format(x) if isinstance(x, (int, float)) else "-"
    for r in rows:
        lines.append(f"| {r['name']} | {r['mode']} | {r['draft'] or '-'} | {r['backend']} | {r['b']} | "
                     f"{fmt(r.get('tok_s'), '{:.1f}')} | {fmt(r.get('vs_ar'), '{:.2f}x')} | "
                     f"{fmt(r.get('accept_len'), '{:.2f}')} | "
                     f"{ {True: 'yes', False: 'NO'}.get(r.get('same_as_ar'), '-')} | {r.get('error') or ''} |")
    with open(os.path.join(args.out, "gpu_check.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", help="dir written by make_synthetic_pair.py")
    ap.add_argument("--out", default="results")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--only", action="append", help="run only this planned server (repeatable), e.g. SSD_noisy")
    ap.add_argument("--server-args", default="", help="extra flags for every server, one string: --server-args='...'")
    ap.add_argument("--server-budget-s", type=int, help="override every server's budget (start + cells), seconds")
    ap.add_argument("--env-json", help="gpu_env.py's report, copied into the results")
    ap.add_argument("--pytest-rc", type=int, default=None)
    ap.add_argument("--pytest-summary", default="")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")
    install_signal_handlers()
    t_start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    n_gpu = torch.cuda.device_count()
    plan = server_plan(args.pair, args.k, n_gpu, args.out, shlex.split(args.server_args))
    if args.only:
        unknown = sorted(set(args.only) - {e["name"] for e in plan})
        if unknown:
            ap.error(f"--only {unknown}: not planned; planned servers: {[e['name'] for e in plan]}")
        plan = [e for e in plan if e["name"] in args.only]
    for e in plan if args.server_budget_s else ():
        e["budget_s"] = args.server_budget_s
    vocab = json.load(open(os.path.join(args.pair, "target", "config.json")))["vocab_size"]
    rows: list[dict] = []
    try:
        for entry in plan:
            serve(entry, vocab, os.path.join(args.out, f"gpu_check_{entry['name']}.log"), rows)
            write_results(args, rows, n_gpu, t_start)
    except SystemExit:  # SIGTERM / SIGINT: the server is stopped; say what was not measured, then exit
        for entry in plan:
            rows += _missing(entry, rows, {"error": "not measured: gpu_bench was stopped (SIGTERM/SIGINT)"})
        write_results(args, rows, n_gpu, t_start)
        raise
    logger.info("wrote %s/gpu_check.{json,md}", args.out)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
