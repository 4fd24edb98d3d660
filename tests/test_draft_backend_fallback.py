"""The draft's FlashInfer start-up falls back to SDPA when its warm-up fails (review finding 3).

On this CPU machine the failure is real: bringing FlashInfer up on a CPU device without the
flashinfer package raises inside DraftRunner.start_attention (as a missing nvcc raises inside the
JIT compile of the first plan() on a GPU machine).  The runner must end on SDPA with one WARNING
naming the cause, produce exactly the logits of a runner that chose SDPA, and say so in Health."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang_ssd.draft.client import DraftClient
from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.flashinfer_attention import flashinfer_available
from sglang_ssd.draft.runner import DraftRunner, ForwardItem
from sglang_ssd.draft.server import DraftServer
from sglang_ssd.draft.tree import fork_indices, tree_kv_len, tree_mask, tree_positions, tree_slots
from tests.tiny_models import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model()


def _fallen_back(model_dir, caplog):
    runner = DraftRunner.from_dir(model_dir)
    assert runner.backend == "sdpa" and runner.backend_fallback is None  # CPU: select_backend chose SDPA
    with caplog.at_level(logging.WARNING, logger="sglang_ssd.draft.runner"):
        assert runner.start_attention("flashinfer") == "sdpa"
    return runner


def _tree_build(runner, k=2):
    prompts, fans = [[3, 9, 27, 4, 8], [7, 1]], [[1, 2, 0], [0, 1, 1]]
    kvs = [runner.new_kv(4) for _ in prompts]
    out = runner.forward([ForwardItem.extend(kv, p, 0, 2) for kv, p in zip(kvs, prompts)])
    out += runner.forward([ForwardItem.extend(kv, [5, 6, 7], len(p), k + 1) for kv, p in zip(kvs, prompts)])
    for d in range(k):
        out += runner.forward([ForwardItem(kv, torch.arange(sum(f)) + d, tree_positions(len(p), fork_indices(f), d),
                                           tree_slots(len(p), k, sum(f), d), tree_kv_len(len(p), k, sum(f), d),
                                           tree_mask(len(p), k, fork_indices(f), d), sum(f))
                               for kv, p, f in zip(kvs, prompts, fans)])
    return out


@pytest.mark.skipif(flashinfer_available(), reason="needs a machine where FlashInfer cannot start on the CPU")
def test_failed_flashinfer_start_falls_back_to_sdpa_with_one_warning(model_dir, caplog):
    runner = _fallen_back(model_dir, caplog)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "FlashInfer warm-up failed" in msg and "falling back to SDPA" in msg
    assert "flashinfer" in runner.backend_fallback and runner.backend_fallback in msg  # the cause, named
    assert runner.backend == "sdpa" and runner.pool is None and runner.workspace is None and runner.graphs is None
    assert type(runner.new_kv()).__name__ == "RequestKV"  # per-request caches again, not pool pages
    ref = DraftRunner.from_dir(model_dir, attention="sdpa")
    for a, b in zip(_tree_build(runner), _tree_build(ref)):
        assert torch.equal(a, b)
    # packed_linears: whatever this CPU's measurement chose for the draft's linears, the same on both runners
    assert runner.health() == {"attention_flashinfer": 0, "attention_fallback": 1, "cuda_graphs": 0,
                               "cuda_graph_replays": 0, "cuda_graph_mem_mb": 0.0,
                               "packed_linears": ref.packed_linears}


@pytest.mark.skipif(flashinfer_available(), reason="needs a machine where FlashInfer cannot start on the CPU")
def test_health_reports_the_attention_backend_and_the_fallback(model_dir, caplog):
    chosen = DraftRunner.from_dir(model_dir)
    fallen = _fallen_back(model_dir, caplog)
    for runner, fallback in ((chosen, 0), (fallen, 1)):
        server = DraftServer(DraftEngine(runner), "ipc")
        server.start_in_thread()
        try:
            with DraftClient(server.endpoint, timeout_s=20) as client:
                stats = client.health()
        finally:
            server.stop()
        assert stats["attention_flashinfer"] == 0 and stats["attention_fallback"] == fallback
        assert stats["cuda_graphs"] == 0
