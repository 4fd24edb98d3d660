"""Opt-in timing of every target forward (``SGLANG_SSD_FORWARD_TIMING=PATH``), for benchmarks.

An AROUND hook on ``ModelRunner.forward`` appends one JSON line per forward to PATH: the forward
mode (decode, target_verify, extend, ...), the batch size, the requests' committed lengths and the
forward's wall time in ms (model forward + logits, no sampling).  The same hook times plain SGLang's
AR decode steps and saguaro's TARGET_VERIFY rounds, so scripts/bench_verify.py compares the two
through SGLang's real model runner.  Unset (the default), nothing is registered.
"""

from __future__ import annotations

import json
import os
import time

ENV = "SGLANG_SSD_FORWARD_TIMING"
MODEL_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def timed_forward(orig, self, forward_batch, *args, **kwargs):
    t0 = time.perf_counter()
    out = orig(self, forward_batch, *args, **kwargs)
    ms = (time.perf_counter() - t0) * 1e3
    try:
        mode = forward_batch.forward_mode.name.lower()
        lens = forward_batch.seq_lens.tolist()
        with open(os.environ[ENV], "a") as fh:
            fh.write(json.dumps({"mode": mode, "bs": len(lens), "seq_lens": lens, "ms": ms,
                                 "draft": bool(getattr(self, "is_draft_worker", False))}) + "\n")
    except Exception:  # timing must never break a forward
        pass
    return out
