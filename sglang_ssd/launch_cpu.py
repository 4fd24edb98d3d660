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


def main(argv: list[str] | None = None) -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.argv = ["sglang.launch_server"] + cpu_args(sys.argv[1:] if argv is None else argv)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
