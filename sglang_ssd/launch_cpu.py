"""Launch the SGLang server on a CPU-only machine: ``python -m sglang_ssd.launch_cpu [sglang flags]``.

Sets what SGLang 0.5.23 needs on CPU (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``,
``--attention-backend torch_native``, no CUDA graphs, no overlap schedule, a bounded KV pool) unless
the caller already passed the flag, then runs ``sglang.launch_server``.  On a GPU machine run
``python -m sglang.launch_server`` directly.

Where transparent huge pages are in ``madvise`` mode (nothing in torch or SGLang asks for them), it
first re-executes itself with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` so that glibc's malloc puts the
heap of the server, its scheduler and the draft it spawns on huge pages: AR +3.9% and SSD +4.8% at
b = 1 on an AMD EPYC VM and a steadier verify (results/variants_thp.md).  ``SGLANG_SSD_HUGEPAGES=0``
turns this off.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

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


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGETLB = "glibc.malloc.hugetlb"


def _glibc_version() -> tuple[int, int]:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" else (0, 0)
    except (ValueError, OSError, AttributeError):
        return (0, 0)


def _thp_mode() -> str:
    """The bracketed word of the kernel's THP setting ('always', 'madvise', 'never'), '' if unknown."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def huge_page_env(environ: dict, thp_mode: str, glibc: tuple[int, int]) -> dict | None:
    """The environment to re-execute with so that malloc madvises huge pages, or None when not wanted:
    opted out, THP not in madvise mode ('always' gives them without asking, 'never' refuses), glibc older
    than 2.35 (no such tunable), or the caller already chose a ``glibc.malloc.hugetlb`` value."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (environ.get("SGLANG_SSD_HUGEPAGES", "1") == "0" or thp_mode != "madvise" or glibc < (2, 35)
            or HUGETLB in tunables):
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGETLB}=1" if tunables else f"{HUGETLB}=1"
    return env


def main(argv: list[str] | None = None) -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    args = cpu_args(sys.argv[1:] if argv is None else argv)
    env = huge_page_env(dict(os.environ), _thp_mode(), _glibc_version())
    if env is not None:  # glibc reads its tunables at process start: start again with them (same pid)
        os.execve(sys.executable, [sys.executable, "-m", "sglang_ssd.launch_cpu", *args], env)
    reserve_draft_core(args)
    sys.argv = ["sglang.launch_server"] + args
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
