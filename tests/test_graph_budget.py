"""CPU tests of the draft's start-up CUDA-graph plan (review finding 10): which buckets are captured
before READY under the memory budget, the budget knob, and that batches only use captured buckets."""

from __future__ import annotations

import pytest

from sglang_ssd.draft.cuda_graphs import (DEFAULT_GRAPH_MB, FI_INT_WORKSPACE, FI_WRAPPER_BYTES, GRAPH_MB_ENV, choose_bucket,
                                          default_buckets, graph_bytes, graph_budget_bytes, mask_buffer_bytes,
                                          startup_buckets)

REQS, TOKS = default_buckets(64), default_buckets(256)
MIB = 2**20


def _cost(nb, tb):
    return graph_bytes(nb, tb, max_kv=8192, page_size=16, token_bytes=4096)


def test_graph_bytes_counts_the_wrapper_buffers_and_grows_with_the_bucket():
    # the 8 MiB int workspace is shared by all graph wrappers (GraphRunner), so no bucket pays it
    assert FI_WRAPPER_BYTES < _cost(1, 1) < FI_INT_WORKSPACE
    assert _cost(1, 1) < _cost(1, 2) < _cost(2, 2)
    assert mask_buffer_bytes(4, 32, 8192) == 32 * 1024 + 4
    # tokens dominate through the mask buffer (1 KiB / token at 8k kv) and the activations
    assert _cost(1, 64) - _cost(1, 32) == 32 * 1024 + 32 * 4096 + 32 * 24


@pytest.mark.parametrize("budget_mb", [0, 9, 100, 256, 1024])
def test_startup_buckets_fit_the_budget_smallest_forwards_first(budget_mb):
    keys = startup_buckets(REQS, TOKS, budget_mb * MIB, _cost)
    assert sum(_cost(*k) for k in keys) <= budget_mb * MIB
    assert all(nb <= tb <= 32 * nb for nb, tb in keys)
    assert keys == sorted(keys, key=lambda x: (x[1], x[0]))
    cands = sorted(((nb, tb) for nb in REQS for tb in TOKS if nb <= tb <= 32 * nb), key=lambda x: (x[1], x[0]))
    assert keys == cands[: len(keys)]  # a prefix of the priority order
    if len(keys) < len(cands):  # stopped because the next one would not fit
        assert sum(_cost(*k) for k in keys) + _cost(*cands[len(keys)]) > budget_mb * MIB


def test_default_budget_captures_every_bucket_of_a_small_draft_and_a_small_budget_the_smallest():
    n_cands = len([1 for nb in REQS for tb in TOKS if nb <= tb <= 32 * nb])
    assert len(startup_buckets(REQS, TOKS, DEFAULT_GRAPH_MB * MIB, _cost)) == n_cands  # ~27 MiB in all
    keys = startup_buckets(REQS, TOKS, 4 * MIB, _cost)
    assert (1, 1) in keys and (4, 16) in keys and (16, 24) in keys
    assert (64, 256) not in keys and len(keys) < n_cands
    assert startup_buckets(REQS, TOKS, 0, _cost) == []


def test_budget_knob():
    assert graph_budget_bytes({}) == DEFAULT_GRAPH_MB * MIB
    assert graph_budget_bytes({GRAPH_MB_ENV: "64"}) == 64 * MIB
    assert graph_budget_bytes({GRAPH_MB_ENV: "0"}) == 0
    for bad in ("-1", "lots"):
        with pytest.raises(ValueError, match=GRAPH_MB_ENV):
            graph_budget_bytes({GRAPH_MB_ENV: bad})


def test_choose_bucket_only_among_captured_buckets():
    allowed = {(4, 16), (8, 32)}
    assert choose_bucket(3, 12, REQS, TOKS) == (4, 16)
    assert choose_bucket(3, 12, REQS, TOKS, allowed) == (4, 16)
    assert choose_bucket(2, 2, REQS, TOKS) == (2, 2)
    assert choose_bucket(2, 2, REQS, TOKS, allowed) == (4, 16)   # smallest captured one that pads
    assert choose_bucket(8, 32, REQS, TOKS, allowed) == (8, 32)   # exact fit, no pad request needed
    assert choose_bucket(8, 31, REQS, TOKS, allowed) is None      # 1 pad token needs a 9th request
    assert choose_bucket(5, 40, REQS, TOKS, allowed) is None      # nothing captured holds it: eager
    assert choose_bucket(1, 1, REQS, TOKS, set()) is None
