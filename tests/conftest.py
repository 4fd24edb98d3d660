import os

import pytest
import torch

from sglang_ssd import paths

# SGLang's CPU recipe (SGLANG_USE_CPU_ENGINE selects its CPU platform); on a CUDA machine (gpu_check's
# GPU tests) SGLang must keep its CUDA platform
if not torch.cuda.is_available():
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def _prepared(path: str) -> str:
    if not paths.is_prepared(path):
        pytest.fail(f"{path} is not prepared: run `python scripts/prepare_models.py` (scripts/test.sh does)")
    return path


@pytest.fixture(scope="session")
def target_path() -> str:
    return _prepared(paths.target_path())


@pytest.fixture(scope="session")
def draft_path() -> str:
    """The trained draft (2 layers, reduced head): the default."""
    return _prepared(paths.draft_path())


@pytest.fixture(scope="session")
def lens_draft_path() -> str:
    """The correctness-grade draft (22 target layers + tuned-lens head), a plain transformers checkpoint."""
    return _prepared(paths.lens_draft_path())
