"""The places the plugin registry's hooks reach into SGLang 0.5.23.

1. ``validate_before_alias``: SGLang reads the draft's HF config while resolving algorithm
   aliases, *before* a custom algorithm's validator runs, so a bad draft path would surface as a
   Hugging Face error that does not name the flag.  For SAGUARO we validate first.
2. ``torch_native_chain_verify``: the ``torch_native`` attention backend (the only CPU backend
   usable with PyPI packages) has no TARGET_VERIFY path.  A chain verify is exactly a causal
   extend of n = K+1 tokens over the committed prefix, whose KV slots the scheduler has already
   registered in ``req_to_token``; so in TARGET_VERIFY mode we hand the extend path the three
   fields it reads and restore them afterwards (shared/notes/cpu-chain-verify.md).  GPU backends
   implement TARGET_VERIFY themselves and never reach this hook.
3. ``chain_verify_graph_spec_info`` (GPU only, registered only when CUDA is available): SGLang's
   decode CUDA-graph runner captures TARGET_VERIFY graphs with a dummy verify input from
   ``DecodeCudaGraphRunner.get_spec_info``, which knows only the builtin algorithms (a custom one
   gets None, and the flashinfer backend's verify planning then fails).  For SAGUARO it returns a
   ``ChainVerifyInput`` over the runner's custom-mask buffer, as the NGRAM branch does; at replay
   the real verify input's chain mask is planned outside the graph.  UNVERIFIED: no GPU was
   available to capture it (scripts/gpu_check.sh exercises it).
"""

from __future__ import annotations

import torch

ALIAS_TARGET = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"
TORCH_NATIVE_EXTEND = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
)
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
    committed = forward_batch.seq_lens
    saved = (forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens)
    try:
        # the chain's n tokens sit at positions committed..committed+n-1 and attend causally to
        # the prefix and to each other: exactly an extend with prefix = committed, extend = n.
        forward_batch.seq_lens = committed + n
        forward_batch.extend_prefix_lens = committed
        forward_batch.extend_seq_lens = torch.full_like(committed, n)
        return orig(self, q, k, v, layer, forward_batch, save_kv_cache)
    finally:
        forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved


def chain_verify_graph_spec_info(orig, self, num_tokens):
    from sglang_ssd.sglang.spec_algo import ALGO_NAME

    if getattr(self.model_runner.spec_algorithm, "name", None) != ALGO_NAME or self.model_runner.is_draft_worker:
        return orig(self, num_tokens)
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_ssd.sglang.verify_input import ChainVerifyInput

    spec = ChainVerifyInput(draft_token=None, custom_mask=self.buffers.custom_mask, positions=None,
                            retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
                            draft_token_num=self.captured_req_width)
    spec.capture_hidden_mode = CaptureHiddenMode.NULL
    return spec
