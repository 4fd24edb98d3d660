"""How the worker launches its own draft process: the command line, the draft's device and CPU core."""

from __future__ import annotations

import os
import sys

import torch

from sglang_ssd.config import SaguaroConfig, resolve_draft_device


def draft_command(cfg: SaguaroConfig, endpoint: str, target_device: torch.device) -> list[str]:
    """`python -m sglang_ssd.draft ...` for a draft serving `endpoint` (resolves cfg.draft_device "auto" in place).

    On a CPU machine of several cores the draft gets the last core unless draft_cpu_core names one, so it does
    not share the target's core (the target's threads are pinned by SGLang or the launcher)."""
    if cfg.draft_device == "auto":  # the worker resolves it with the target's GPU set first
        gpus = torch.cuda.device_count() if target_device.type == "cuda" else 0
        cfg.draft_device, _ = resolve_draft_device("auto", str(target_device), {target_device.index or 0}, gpus)
    cmd = [sys.executable, "-m", "sglang_ssd.draft", "--model", cfg.draft_model_path,
           "--device", cfg.draft_device, "--bind", endpoint,
           "--dtype", cfg.draft_dtype, "--threads", str(cfg.draft_threads)]
    if cfg.target_model_path:  # an EAGLE-3 head reads the target's embedding and layer count
        cmd += ["--target-model", cfg.target_model_path]
    core = cfg.draft_cpu_core
    if core is None and cfg.draft_device == "cpu" and (os.cpu_count() or 1) > 1:
        core = (os.cpu_count() or 1) - 1
    if core is not None:
        cmd += ["--cpu-core", str(core)]
    if cfg.curve_keys is not None:
        cmd += ["--curve-keys", cfg.curve_keys]
    return cmd
