"""gpu_check step: build the draft's FlashInfer kernels once, before anything timed (review finding 3).

flashinfer 0.7.2 JIT-compiles a kernel family the first time it is planned (SGLang pulls no prebuilt
cubins) and caches it on disk.  Starting a DraftRunner on the GPU runs exactly the warm-up and start-up
graph capture a served draft runs before READY (runner.start_attention), with the synthetic pair's draft
shapes, so the tests and the SSD servers that follow find the modules compiled.  A failed warm-up is
reported (the draft then serves on SDPA), not fatal: that is itself a result of the check.

    python scripts/gpu_warm.py PAIR_DIR [--out results/gpu_check_warm.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sglang_ssd.draft.runner import DraftRunner  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    runner = DraftRunner.from_dir(os.path.join(args.pair, "draft_noisy"), args.device, "bfloat16")
    res = {"backend": runner.backend, "fallback": runner.backend_fallback, "seconds": time.perf_counter() - t0,
           **runner.health()}
    print("[gpu_warm] " + json.dumps(res))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
