"""Where prepared models live (shared by scripts/prepare_models.py, the demo, tests, benchmarks)."""

from __future__ import annotations

import os

TARGET_NAME = "smollm2-135m-instruct"
DRAFT_NAME = "smollm2-135m-draft"            # the trained draft (issue 4): the default
LENS_DRAFT_NAME = "smollm2-135m-draft-lens"  # correctness-grade: 22 target layers + tuned-lens head


def models_dir() -> str:
    return os.path.expanduser(os.environ.get("SGLANG_SSD_MODELS", "~/.cache/sglang-ssd/models"))


def target_path() -> str:
    return os.path.join(models_dir(), TARGET_NAME)


def draft_path() -> str:
    return os.path.join(models_dir(), DRAFT_NAME)


def lens_draft_path() -> str:
    return os.path.join(models_dir(), LENS_DRAFT_NAME)


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "PREPARED.json"))
