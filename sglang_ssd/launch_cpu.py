"""Launch the SGLang server on a CPU-only machine: ``python -m sglang_ssd.launch_cpu [sglang flags]``.

Sets what SGLang 0.5.23 needs on CPU (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``,
``--attention-backend torch_native``, no CUDA graphs, no overlap schedule, a bounded KV pool) unless
the caller already passed the flag, then runs ``sglang.launch_server``.  On a GPU machine run
``python -m sglang.launch_server`` directly.
"""

from __future__ import annotations

import os
import runpy
import sys

CPU_DEFAULTS = [
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--max-total-tokens", "32768"),
    ("--disable-cuda-graph", None),
    ("--disable-overlap-schedule", None),
]


def cpu_args(argv: list[str]) -> list[str]:
    out = list(argv)
    for flag, value in CPU_DEFAULTS:
        if flag not in out and not any(a.startswith(flag + "=") for a in out):
            out += [flag] if value is None else [flag, value]
    return out


def reserve_draft_core(argv: list[str]) -> None:
    """With saguaro and a CPU draft, keep the server's processes off the draft's core (the draft pins
    itself there): two busy processes sharing cores make both several times slower."""
    if not any(a.lower() in ("saguaro", "--speculative-algorithm=saguaro") for a in argv):
        return
    from sglang_ssd.config import load_env_config

    extra = load_env_config(os.environ)
    if extra.get("draft_device", "cpu") != "cpu" or not extra.get("spawn_draft", True):
        return
    allowed = sorted(os.sched_getaffinity(0))
    draft_core = extra.get("draft_cpu_core")
    if draft_core is None:
        draft_core = (os.cpu_count() or 1) - 1
    rest = [c for c in allowed if c != draft_core]
    if rest and len(rest) < len(allowed):
        os.sched_setaffinity(0, rest)


def main(argv: list[str] | None = None) -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    args = cpu_args(sys.argv[1:] if argv is None else argv)
    reserve_draft_core(args)
    sys.argv = ["sglang.launch_server"] + args
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
