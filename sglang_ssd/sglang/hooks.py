"""The places the plugin registry's hooks reach into SGLang 0.5.23.

1. ``validate_before_alias``: SGLang reads the draft's HF config while resolving algorithm
   aliases, *before* a custom algorithm's validator runs, so a bad draft path would surface as a
   Hugging Face error that does not name the flag.  For SAGUARO we validate first.
2. ``torch_native_chain_verify``: the ``torch_native`` attention backend (the only CPU backend
   usable with PyPI packages) has no TARGET_VERIFY path.  A chain verify is exactly a causal
   extend of n = K+1 tokens over the committed prefix, whose KV slots the scheduler has already
   registered in ``req_to_token``.  In TARGET_VERIFY mode we write the chain's KV and compute
   attention for exactly the n chain queries per request (``sglang_ssd/cpu/chain_attention.py``,
   linear in context).  torch_native's own extend path would attend from every position of the
   request (quadratic); it remains the route for sliding-window / cross attention, reached by
   handing it the three fields it reads (shared/notes/cpu-chain-verify.md).  GPU backends
   implement TARGET_VERIFY themselves and never reach this hook.
3. ``chain_verify_graph_spec_info`` (GPU only, registered only when CUDA is available): SGLang's
   decode CUDA-graph runner captures TARGET_VERIFY graphs with a dummy verify input from
   ``DecodeCudaGraphRunner.get_spec_info``, which knows only the builtin algorithms (a custom one
   gets None, and the flashinfer backend's verify planning then fails).  For SAGUARO it returns a
   ``ChainVerifyInput`` over the runner's custom-mask buffer, as the NGRAM branch does; at replay
   the real verify input's chain mask is planned outside the graph.  UNVERIFIED: no GPU was
   available to capture it (scripts/gpu_check.sh exercises it).
4. ``chain_verify_dummy_input`` (registered everywhere; only GPU warm-ups call it): the FlashInfer
   autotune warm-up of MoE / FP8 / FP4 targets runs a TARGET_VERIFY dummy forward with
   ``spec_info.create_dummy_verify_input``, which returns None for a custom algorithm; the flashinfer
   backend then asserts on the missing verify input.  For SAGUARO it returns the same
   ``ChainVerifyInput`` over the runner's mask buffer as (3).
"""

from __future__ import annotations

import os

import torch

# "extend" forces the old quadratic route (torch_native's extend path) for before/after benchmarks
CHAIN_VERIFY_ENV = "SGLANG_SSD_CHAIN_VERIFY"
ALIAS_TARGET = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"
TORCH_NATIVE_EXTEND = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
)
DUMMY_VERIFY_INPUT = "sglang.srt.speculative.spec_info.create_dummy_verify_input"
GRAPH_SPEC_INFO = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"
)


def validate_before_alias(orig, speculative_algorithm, speculative_draft_model_path, *args, **kwargs):
    if speculative_algorithm is not None and speculative_algorithm.upper() == "SAGUARO":
        from sglang_ssd.config import DRAFT_FLAG, SaguaroConfigError, validate_draft_path

        if not speculative_draft_model_path:
            raise SaguaroConfigError(
                f"saguaro needs a draft model: pass {DRAFT_FLAG} DIR (a Hugging Face checkpoint "
                "directory sharing the target's tokenizer)")
        validate_draft_path(speculative_draft_model_path)
    return orig(speculative_algorithm, speculative_draft_model_path, *args, **kwargs)


def torch_native_chain_verify(orig, self, q, k, v, layer, forward_batch, save_kv_cache=True):
    if not forward_batch.forward_mode.is_target_verify():
        return orig(self, q, k, v, layer, forward_batch, save_kv_cache)
    spec = forward_batch.spec_info
    if getattr(spec, "tree_topk", None) != 1:
        raise NotImplementedError(
            "torch_native TARGET_VERIFY supports chains only (tree_topk == 1); "
            "tree verification needs a GPU attention backend")
    n = spec.draft_token_num
    if os.environ.get(CHAIN_VERIFY_ENV) != "extend" and _plain_self_attention(self, layer, forward_batch):
        return _linear_chain_verify(self, q, k, v, layer, forward_batch, n, save_kv_cache)
    committed = forward_batch.seq_lens
    saved = (forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens)
    try:
        # the chain's n tokens sit at positions committed..committed+n-1 and attend causally to
        # the prefix and to each other: exactly an extend with prefix = committed, extend = n.
        # (quadratic in context: torch_native's extend attends from every position of the request)
        forward_batch.seq_lens = committed + n
        forward_batch.extend_prefix_lens = committed
        forward_batch.extend_seq_lens = torch.full_like(committed, n)
        return orig(self, q, k, v, layer, forward_batch, save_kv_cache)
    finally:
        forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved


def _plain_self_attention(backend, layer, forward_batch) -> bool:
    """Decoder self-attention over one full KV pool: what the linear chain path computes.  Sliding
    windows, SWA pools, cross / encoder attention keep the (exact, quadratic) extend route."""
    window = getattr(layer, "sliding_window_size", None)
    return (not layer.is_cross_attention and getattr(forward_batch, "encoder_lens", None) is None
            and (window is None or window <= -1) and not backend.use_sliding_window_kv_pool
            and getattr(layer, "attn_type", None) != _encoder_only())


def _encoder_only():
    from sglang.srt.layers.radix_attention import AttentionType

    return AttentionType.ENCODER_ONLY


def _linear_chain_verify(backend, q, k, v, layer, forward_batch, n, save_kv_cache):
    """TARGET_VERIFY at linear cost: write the chain's KV (as the extend path does), then attend
    only the n chain queries per request (sglang_ssd/cpu/chain_attention.py)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_ssd.cpu.chain_attention import chain_verify_attention

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    prefix = forward_batch.seq_lens.tolist()  # committed lengths (a CPU tensor: no device sync)
    o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    chain_verify_attention(
        q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
        backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
        backend.token_to_kv_pool.get_value_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, prefix, n,
        scaling=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
    return o


def _dummy_chain_input(custom_mask, width: int):
    """A shape-only chain verify input over a runner's mask buffer (what NGRAM's dummy is for NGRAM)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_ssd.sglang.verify_input import ChainVerifyInput

    spec = ChainVerifyInput(draft_token=None, custom_mask=custom_mask, positions=None,
                            retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
                            draft_token_num=width)
    spec.capture_hidden_mode = CaptureHiddenMode.NULL
    return spec


def _is_saguaro(spec_algorithm) -> bool:
    from sglang_ssd.sglang.spec_algo import ALGO_NAME

    return getattr(spec_algorithm, "name", None) == ALGO_NAME


def chain_verify_graph_spec_info(orig, self, num_tokens):
    if not _is_saguaro(self.model_runner.spec_algorithm) or self.model_runner.is_draft_worker:
        return orig(self, num_tokens)
    return _dummy_chain_input(self.buffers.custom_mask, self.captured_req_width)


def chain_verify_dummy_input(orig, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs):
    if not _is_saguaro(spec_algorithm) or is_draft_worker:
        return orig(spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs)
    return _dummy_chain_input(custom_mask, num_tokens_per_req)
