"""The target's GPU verify inputs, checked on CPU: the chain's FULL custom mask (the layout SGLang's
NGRAM worker hands the flashinfer/triton backends), the CUDA-graph dummy verify input hook, and
which server arguments saguaro forces on CPU vs GPU.  The GPU forward itself is exercised only by
scripts/gpu_check.sh (no GPU here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ssd.sglang import hooks
from sglang_ssd.sglang.spec_algo import ALGO_NAME, SaguaroAlgo, worker_factory
from sglang_ssd.sglang.verify_input import ChainVerifyInput, build_chain_verify_input, chain_full_mask


def ngram_style_full_mask(seq_lens: list[int], n: int) -> torch.Tensor:
    """What ngram_worker builds with USE_FULL_MASK: per request ones(n, L) | tree_mask(n, n), flattened."""
    tril = torch.tril(torch.ones(n, n, dtype=torch.bool))  # a chain: node j's ancestors are 0..j
    return torch.cat([torch.cat([torch.ones(n, L, dtype=torch.bool), tril], 1).reshape(-1) for L in seq_lens])


@pytest.mark.parametrize("seq_lens,n", [([5], 1), ([5], 4), ([0, 7, 130, 1], 5), ([33, 2], 2)])
def test_chain_full_mask_is_ngram_full_layout(seq_lens, n):
    lens = torch.tensor(seq_lens)
    ref = ngram_style_full_mask(seq_lens, n)
    assert torch.equal(chain_full_mask(lens, n), ref)
    assert torch.equal(chain_full_mask(lens, n, seq_lens_cpu=lens.clone()), ref)
    # the size NgramVerifyInput.generate_attn_arg_prefill expects (it pads, never truncates)
    assert ref.numel() == sum(seq_lens) * n + n * n * len(seq_lens)


def test_chain_full_mask_rows_are_causal():
    m = chain_full_mask(torch.tensor([3, 6]), 3)
    blk0 = m[: 3 * 6].view(3, 6)
    blk1 = m[3 * 6 :].view(3, 9)
    for blk, L in ((blk0, 3), (blk1, 6)):
        for j in range(3):
            assert blk[j].tolist() == [True] * (L + j + 1) + [False] * (2 - j)


def test_verify_input_cpu_has_no_mask_gpu_has_full_mask():
    chain = torch.tensor([[1, 2, 3], [4, 5, 6]])
    lens = torch.tensor([10, 3])
    cpu = build_chain_verify_input(chain, lens)
    assert cpu.custom_mask is None and cpu.tree_topk == 1 and cpu.max_tree_depth == 3
    gpu = build_chain_verify_input(chain, lens, full_mask=True, seq_lens_cpu=lens)
    assert torch.equal(gpu.custom_mask, ngram_style_full_mask([10, 3], 3))
    assert gpu.positions.tolist() == [10, 11, 12, 3, 4, 5] and gpu.num_tokens_per_req == 3


def _fake_graph_runner(name, draft=False):
    algo = SaguaroAlgo(name, worker_factory) if name == ALGO_NAME else SimpleNamespace(name=name)
    return SimpleNamespace(model_runner=SimpleNamespace(spec_algorithm=algo, is_draft_worker=draft),
                           buffers=SimpleNamespace(custom_mask=torch.ones(64, dtype=torch.bool)),
                           captured_req_width=5)


def test_graph_spec_info_hook_builds_chain_input_for_saguaro_only():
    orig = lambda self, num_tokens: ("orig", num_tokens)
    spec = hooks.chain_verify_graph_spec_info(orig, _fake_graph_runner(ALGO_NAME), 20)
    assert isinstance(spec, ChainVerifyInput)
    assert spec.draft_token_num == 5 and spec.num_tokens_per_req == 5 and spec.tree_topk == 1
    assert spec.custom_mask.numel() == 64
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    assert spec.capture_hidden_mode == CaptureHiddenMode.NULL
    assert hooks.chain_verify_graph_spec_info(orig, _fake_graph_runner("NGRAM"), 20) == ("orig", 20)
    assert hooks.chain_verify_graph_spec_info(orig, _fake_graph_runner(ALGO_NAME, draft=True), 7) == ("orig", 7)


def _args(device):
    return SimpleNamespace(speculative_num_steps=3, speculative_num_draft_tokens=None, speculative_eagle_topk=None,
                           disable_overlap_schedule=False, disable_cuda_graph=False, grammar_backend=None,
                           max_running_requests=None, device=device)


def test_cuda_graphs_forced_off_on_cpu_only():
    algo = SaguaroAlgo(ALGO_NAME, worker_factory)
    a = _args("cpu")
    algo.handle_server_args(a)
    assert a.disable_cuda_graph is True and a.speculative_num_draft_tokens == 4
    b = _args("cuda")
    algo.handle_server_args(b)
    assert b.disable_cuda_graph is (not torch.cuda.is_available())


def _backend(name, **attrs):
    return type(name, (), attrs)()  # the rule goes by SGLang's class names (their modules need CUDA)


def test_mask_built_only_for_backends_that_read_it():
    from sglang_ssd.sglang.verify_input import verify_reads_mask

    assert verify_reads_mask(_backend("FlashInferAttnBackend")) is True
    assert verify_reads_mask(_backend("TritonAttnBackend")) is True
    assert verify_reads_mask(_backend("FlashAttentionBackend", topk=1)) is False   # fa3 / fa4, a chain
    assert verify_reads_mask(_backend("FlashAttentionBackend", topk=0)) is False
    assert verify_reads_mask(_backend("FlashAttentionBackend", topk=4)) is True    # tree verify reads it
    assert verify_reads_mask(None) is True                                         # unknown: build it
    fa3, fi = _backend("FlashAttentionBackend", topk=1), _backend("FlashInferAttnBackend")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    def hybrid(verify_backend):  # HybridAttnBackend resolves TARGET_VERIFY to one of its two
        return _backend("HybridAttnBackend", _select_backend=lambda self, mode: (
            verify_backend if mode == ForwardMode.TARGET_VERIFY else None))

    assert verify_reads_mask(hybrid(fa3)) is False and verify_reads_mask(hybrid(fi)) is True
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    assert verify_reads_mask(TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)) is False


def test_dummy_verify_input_hook_for_saguaro_only():
    orig = lambda algo, mask, n, draft, *a: ("orig", n)
    saguaro = SaguaroAlgo(ALGO_NAME, worker_factory)
    mask = torch.ones(40, dtype=torch.bool)
    spec = hooks.chain_verify_dummy_input(orig, saguaro, mask, 4, False)
    assert isinstance(spec, ChainVerifyInput) and spec.draft_token_num == 4 and spec.custom_mask is mask
    assert hooks.chain_verify_dummy_input(orig, SimpleNamespace(name="NGRAM"), mask, 4, False) == ("orig", 4)
    assert hooks.chain_verify_dummy_input(orig, saguaro, mask, 4, True) == ("orig", 4)
