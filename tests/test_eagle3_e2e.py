"""An EAGLE-3 head served end to end: the real SGLang scheduler captures the target's hidden states at the
head's layers (prefill and every verify), the worker sends them with each Speculate, the draft process
conditions on them.  Greedy output equals plain SGLang's token for token in async (SSD) and sync (SD)
mode, and the draft really received the features (its own count of feature rows).

The head is random (tests/tiny_models.make_eagle3_head: the published layout for SmolLM2, untrained),
so few drafts are accepted: this checks exactness and the plumbing; the engine-level reference test
(test_eagle3_draft.py) checks what the draft computes from the features."""

import concurrent.futures as cf

import pytest

from sglang_ssd.draft.client import DraftClient
from sglang_ssd.serving import SGLangServer
from tests.test_saguaro_server import COMMON, _saguaro_server
from tests.tiny_models import make_eagle3_head

pytestmark = pytest.mark.server
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def eagle_head(target_path, tmp_path_factory):
    return make_eagle3_head(target_path, str(tmp_path_factory.mktemp("eagle3") / "head"), seed=0)


@pytest.fixture(scope="module")
def prompts(target_path):
    from transformers import AutoTokenizer

    from tests.prompts import all_prompt_ids

    return all_prompt_ids(AutoTokenizer.from_pretrained(target_path))[:4]


def _greedy(srv, prompts):
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with cf.ThreadPoolExecutor(4) as pool:  # concurrent: batches of several requests
        return [f.result() for f in
                [pool.submit(srv.generate, input_ids=ids, sampling_params=params) for ids in prompts]]


@pytest.fixture(scope="module")
def reference(target_path, prompts, tmp_path_factory):
    log = tmp_path_factory.mktemp("ar-eagle") / "server.log"
    with SGLangServer(target_path, COMMON, cpu_core=0, log_path=str(log)) as srv:
        return [r["output_ids"] for r in _greedy(srv, prompts)]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_eagle3_head_equals_plain_sglang(mode, target_path, eagle_head, prompts, reference, tmp_path):
    with _saguaro_server(target_path, eagle_head, mode, tmp_path) as srv:
        res = _greedy(srv, prompts)
        got = [r["output_ids"] for r in res]
        with DraftClient(srv.draft_endpoint, timeout_s=30) as c:
            health = c.health()
    for i, (a, b) in enumerate(zip(got, reference)):
        assert a == b, f"prompt {i}: saguaro ({mode}, EAGLE-3 head) diverged from plain SGLang"
    # every prompt position the target's prefill ran (not the radix-cached prefix: SGLang reuses its KV and
    # computes no hidden states there) and every committed verify position came over as a feature row;
    # the last round's (<= K + 1 rows) are never sent
    ran = sum(len(p) - r["meta_info"]["cached_tokens"] for p, r in zip(prompts, res))
    want = ran + len(prompts) * (NEW_TOKENS - 1 - 5)
    assert health["feature_rows"] >= want, (health["feature_rows"], want)
    assert health["rounds"] > 0
