"""The GPU check's plan: every SGLang server it starts (args + env) and the time each step may take.

One source for scripts/gpu_bench.py (which starts the servers), scripts/gpu_check.sh (which
enforces the step budgets with `timeout`) and the CPU test that parses every planned command line
with SGLang's own parser (tests/test_gpu_scripts_plan.py).

  python scripts/gpu_plan.py check PAIR [--n-gpu N]   parse + validate every server; budget table
  python scripts/gpu_plan.py budgets                  shell assignments of the step budgets

Budgets (seconds, one H200; the whole check must fit in 10 minutes including model loads and
CUDA-graph capture).  Step budgets are enforced by gpu_check.sh with `timeout`; a server's budget
(start + warm-up + its cells) by gpu_bench.py with an alarm; gpu_bench as a whole by `timeout`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shlex
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sglang_ssd.serving import SGLangServer  # noqa: E402

TOTAL_S = 600  # 10 minutes on one H200
# before the servers; "warm" compiles the draft's FlashInfer kernels (JIT, cached) so nothing later pays it
STEP_S = {"preflight": 20, "synth": 20, "plan": 20, "warm": 90, "tests": 100}
BENCH_GRACE_S = 30  # gpu_bench's own start-up and the servers' stops, on top of the server budgets
CONFIG_ENV = "SGLANG_SSD_CONFIG"
RUN_ENV = "SGLANG_SSD_GPU_CHECK_RUN"  # tags every process of one gpu_check run (cleanup finds them)

# name, draft, mode, attention backend (None = SGLang's default: fa3 on H200), batch sizes, budget
# (SD with the equal draft is left out for time: SSD_equal vs AR shows the acceptance-1 case)
_SERVERS = [
    ("AR", None, None, None, (1, 4, 16), 45),
    ("SSD_equal", "draft_equal", "async", None, (1, 4, 16), 45),
    ("SD_noisy", "draft_noisy", "sync", None, (1, 4, 16), 45),
    ("SSD_noisy", "draft_noisy", "async", None, (1, 4, 16), 45),
    # the custom-mask TARGET_VERIFY path and the CUDA-graph hook run only on these two backends; the
    # target's own flashinfer backend JIT-compiles its modules in its first start: more time there
    ("SSD_noisy_flashinfer", "draft_noisy", "async", "flashinfer", (1, 16), 90),
    ("SSD_noisy_triton", "draft_noisy", "async", "triton", (1, 16), 45),
]
MODE_LABEL = {None: "AR", "sync": "SD", "async": "SSD"}


def server_plan(pair: str, k: int = 4, n_gpu: int = 1, out: str = "results",
                extra_args: list[str] | tuple = ()) -> list[dict]:
    """Every server gpu_bench starts, in order: {name, label, model, draft, mode, backend, args, env,
    batch_sizes, budget_s}.  ``args`` are the flags after the ones SGLangServer adds (launch_argv);
    ``extra_args`` (gpu_check.sh: $GPU_CHECK_SERVER_ARGS, e.g. --disable-cuda-graph) go last."""
    shared = n_gpu < 2
    # prefill CUDA graphs (on by default on CUDA in 0.5.23) would add their capture to every start
    common = ["--skip-tokenizer-init", "--dtype", "bfloat16", "--max-running-requests", "16",
              "--cuda-graph-max-bs-decode", "16", "--disable-prefill-cuda-graph", "--random-seed", "0",
              "--mem-fraction-static", "0.45" if shared else "0.8"]
    plan = []
    for name, draft, mode, backend, bss, budget in _SERVERS:
        args, env = list(common), {}
        if backend:
            args += ["--attention-backend", backend]
        if draft:
            args += ["--speculative-algorithm", "saguaro", "--speculative-num-steps", str(k),
                     "--speculative-draft-model-path", os.path.join(pair, draft)]
            env[CONFIG_ENV] = json.dumps({"mode": mode, "draft_device": "cuda:0" if shared else "cuda:1",
                                          "stats_file": os.path.join(out, f"gpu_check_{name}.stats.json")})
        args += list(extra_args)
        plan.append({"name": name, "label": MODE_LABEL[mode], "model": os.path.join(pair, "target"),
                     "draft": draft, "mode": mode, "backend": backend, "args": args, "env": env,
                     "batch_sizes": list(bss), "budget_s": budget})
    return plan


def launch_argv(entry: dict, port: int = 30000) -> list[str]:
    """The argv sglang.launch_server gets from sglang_ssd.serving.SGLangServer.start."""
    return SGLangServer.launch_argv(entry["model"], port, entry["args"])


def bench_budget_s(plan: list[dict]) -> int:
    return sum(e["budget_s"] for e in plan) + BENCH_GRACE_S


@contextlib.contextmanager
def _quiet_sglang():
    """prepare_server_args re-configures the root logger (basicConfig force=True) and argparse writes
    its usage to stderr: keep both out of the caller's logging and output."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield err
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@contextlib.contextmanager
def _env(extra: dict):
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_entry(entry: dict) -> str | None:
    """None if SGLang 0.5.23 accepts this server's command line, else the reason.

    Runs what `python -m sglang.launch_server` runs before it touches a device: the plugins, then
    prepare_server_args(argv) (SGLang's argparse parser + ServerArgs.from_cli_args; resolution,
    which needs the device, comes later), and for saguaro the launch-time validation the plugin
    registered (its whole config, env included, and the draft checkpoint)."""
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative import spec_registry

    try:
        with _quiet_sglang() as err:
            sa = prepare_server_args(launch_argv(entry))
    except SystemExit as exc:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        return f"argparse exit {exc.code}: {lines[-1] if lines else 'no message'}"
    if sa.attention_backend != entry["backend"]:
        return f"--attention-backend parsed as {sa.attention_backend!r}, planned {entry['backend']!r}"
    if entry["mode"] is None:
        return None
    spec = spec_registry.get_spec(sa.speculative_algorithm)
    if spec is None:
        return f"speculative algorithm {sa.speculative_algorithm!r} is not registered (plugin not loaded?)"
    try:
        with _env(entry["env"]):
            spec.validate_server_args(sa)
    except Exception as exc:  # the message is the plugin's own, naming the flag or config key
        return f"saguaro validation: {type(exc).__name__}: {exc}"
    return None


def check_plan(plan: list[dict]) -> dict[str, str | None]:
    from sglang.srt.plugins import load_plugins

    with _quiet_sglang():  # SGLang's plugin listing; a plugin that failed to load shows per entry
        load_plugins()
    return {e["name"]: check_entry(e) for e in plan}


def budget_rows(plan: list[dict]) -> list[tuple[str, int, str]]:
    rows = [(step, s, "timeout in gpu_check.sh") for step, s in STEP_S.items()]
    rows += [(f"server {e['name']}", e["budget_s"], f"start + warm-up + b={','.join(map(str, e['batch_sizes']))}"
              f" ({e['backend'] or 'default backend'})") for e in plan]
    rows.append(("bench grace", BENCH_GRACE_S, "gpu_bench start-up + server stops"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="parse and validate every planned server; print the budget table")
    c.add_argument("pair", help="dir written by make_synthetic_pair.py (draft paths are validated)")
    c.add_argument("--n-gpu", type=int, default=1)
    c.add_argument("--k", type=int, default=4)
    c.add_argument("--out", default="results")
    c.add_argument("--server-args", default="", help="extra flags for every server, one string: --server-args='...'")
    sub.add_parser("budgets", help="the step budgets as shell assignments (for gpu_check.sh)")
    args = ap.parse_args(argv)
    if args.cmd == "budgets":
        plan = server_plan("PAIR")
        print(" ".join(f"{k.upper()}_S={v}" for k, v in STEP_S.items()) + f" BENCH_S={bench_budget_s(plan)}"
              f" TOTAL_S={TOTAL_S}")
        return 0
    plan = server_plan(args.pair, args.k, args.n_gpu, args.out, shlex.split(args.server_args))
    results = check_plan(plan)
    for e in plan:
        bad = results[e["name"]]
        print(f"[plan] server {e['name']:<22} {'parsed OK' if bad is None else 'FAILED: ' + bad}")
    rows = budget_rows(plan)
    total = sum(s for _, s, _ in rows)
    print("\n| step | budget s | what |\n|---|---|---|")
    for step, s, what in rows:
        print(f"| {step} | {s} | {what} |")
    print(f"| total | {total} | limit {TOTAL_S} (one H200) |")
    if total > TOTAL_S:
        print(f"[plan] FAILED: the budgets add up to {total} s, over the {TOTAL_S} s limit")
        return 1
    n_bad = sum(r is not None for r in results.values())
    if n_bad:
        print(f"[plan] FAILED: {n_bad} of {len(plan)} server command lines rejected")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
