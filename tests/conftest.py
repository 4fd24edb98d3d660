import os
import sys

import pytest
import torch

from sglang_ssd import paths

# SGLang's CPU recipe (SGLANG_USE_CPU_ENGINE selects its CPU platform); on a CUDA machine (gpu_check's
# GPU tests) SGLang must keep its CUDA platform
if not torch.cuda.is_available():
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
# draft_dtype auto on a CPU measures whether bf16 pays (draft/cpu_dtype.py); the suite pins float32 so its
# numerics checks (tree vs chain, vs transformers) do not depend on the CPU model (test_cpu_dtype unpins it)
os.environ.setdefault("SGLANG_SSD_DRAFT_CPU_DTYPE", "float32")
# the target's row costs (auto K, batch-size-aware K) are measured once per suite run, into a directory of
# its own: nothing from an earlier run or another checkout (cpu/row_cost_probe.py's disk cache)
if "SGLANG_SSD_ROW_COST_CACHE" not in os.environ:
    import tempfile

    os.environ["SGLANG_SSD_ROW_COST_CACHE"] = tempfile.mkdtemp(prefix="sglang-ssd-row-costs-")


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


@pytest.fixture(scope="module")
def synthetic_pair(tmp_path_factory) -> str:
    """A minute synthetic target + equal / noisy drafts (scripts/make_synthetic_pair.py): the GPU scripts'
    pair, small enough that their CPU tests build it in a second."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import make_synthetic_pair

    out = tmp_path_factory.mktemp("pair")
    assert make_synthetic_pair.main([str(out), "--hidden", "64", "--layers", "1", "--heads", "2",
                                     "--kv-heads", "1"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def no_lookup():
    """The draft's own choices, without the prompt or corpus lookup (saguaro/lookup.py, datastore.py), for a
    module whose tests compare proposals with a plain sequential decode of the draft (the lookups have their own
    references in test_greedy_lookup.py and test_datastore.py).  Module-scoped so engines and draft processes made by module fixtures see it too."""
    from sglang_ssd.saguaro.lookup import CORPUS_ENV, LOOKUP_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LOOKUP_ENV, "off")
        mp.setenv(CORPUS_ENV, "off")
        yield
