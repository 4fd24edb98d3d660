"""The SAGUARO entry in SGLang's speculative-algorithm registry.

``CustomSpecAlgo`` (SGLang 0.5.23) lacks three methods the scheduler calls
(``carries_draft_hidden_states``, ``create_future_map``, ``need_topk``; see
shared/notes/sglang-integration.md section 2); this subclass adds them, declares that the draft
keeps no KV in SGLang's pools, and sets the server arguments a custom algorithm does not get
by default.
"""

from __future__ import annotations

import logging

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_ssd.config import K_FLAG, SaguaroConfig, SaguaroConfigError

logger = logging.getLogger(__name__)

ALGO_NAME = "SAGUARO"
DEFAULT_K = 4
DEFAULT_MAX_RUNNING_REQUESTS = 48


class SaguaroAlgo(CustomSpecAlgo):
    def carries_draft_hidden_states(self) -> bool:
        return False  # no EAGLE hidden states travel between prefill and decode servers

    def need_topk(self) -> bool:
        return False  # SSD verifies chains: one draft token per depth

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                          needs_confidence_relay=False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def has_draft_kv(self) -> bool:
        # The draft's KV lives in the draft process, not in SGLang's pools: the per-decode KV
        # reserve becomes max(steps * topk, num_draft_tokens) = K + 1.
        return False

    def handle_server_args(self, server_args) -> None:
        k = server_args.speculative_num_steps or DEFAULT_K
        n = server_args.speculative_num_draft_tokens
        if n is not None and n != k + 1:
            raise SaguaroConfigError(
                f"--speculative-num-draft-tokens must be K+1 = {k + 1} for saguaro (K from {K_FLAG}), "
                f"got {n}; omit it and saguaro sets it")
        topk = server_args.speculative_eagle_topk
        if topk not in (None, 1):
            raise SaguaroConfigError(
                f"--speculative-eagle-topk must be 1 for saguaro (the target verifies a chain; "
                f"branching happens in the draft's speculation cache), got {topk}")
        server_args.speculative_num_steps = k
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = k + 1
        # Overlap scheduling is not implemented yet: the worker reads req.output_ids synchronously.
        server_args.disable_overlap_schedule = True
        # CPU: no verify graphs (SGLang's CPU graph runner refuses speculative algorithms).  GPU:
        # TARGET_VERIFY graphs are captured with hooks.chain_verify_graph_spec_info (UNVERIFIED on
        # hardware: if capture fails, launch with --disable-cuda-graph).
        if not _cuda_target(server_args):
            server_args.disable_cuda_graph = True
        # Grammar-constrained decoding: SGLang's grammar backend (xgrammar by default) as in a plain
        # server; the chain verify masks every chain position (sglang_ssd/sglang/grammar.py).
        if server_args.max_running_requests is None:
            server_args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS


def _cuda_target(server_args) -> bool:
    import torch

    return getattr(server_args, "device", None) in (None, "cuda") and torch.cuda.is_available()


def validate_server_args(server_args) -> None:
    """Runs at launch, before any process starts: parse and validate the whole saguaro config."""
    cfg = SaguaroConfig.from_sources(server_args.speculative_draft_model_path,
                                     server_args.speculative_num_steps or DEFAULT_K)
    if server_args.speculative_draft_model_path and server_args.model_path:
        from sglang_ssd.sglang.compat import check_draft_matches_target

        check_draft_matches_target(server_args.model_path, cfg.draft_model_path)
    backend = getattr(server_args, "sampling_backend", None)
    if backend is not None:
        from sglang_ssd.saguaro.target_dist import sampler_filter_order

        try:
            sampler_filter_order(backend, need_min_p=False)
        except ValueError as exc:
            raise SaguaroConfigError(str(exc)) from None
    logger.info("saguaro config: %s", cfg.to_json())


def worker_factory(server_args):
    from sglang_ssd.sglang.worker import SaguaroWorker

    return SaguaroWorker
