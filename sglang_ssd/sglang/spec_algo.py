"""The SAGUARO entry in SGLang's speculative-algorithm registry.

``CustomSpecAlgo`` (SGLang 0.5.23) lacks three methods the scheduler calls
(``carries_draft_hidden_states``, ``create_future_map``, ``need_topk``; see
shared/notes/sglang-integration.md section 2); this subclass adds them, declares that the draft
keeps no KV in SGLang's pools, and sets the server arguments a custom algorithm does not get
by default.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_ssd.config import K_FLAG, SaguaroConfig, SaguaroConfigError, check_alpha_prior, load_env_config

logger = logging.getLogger(__name__)

ALGO_NAME = "SAGUARO"
DEFAULT_K = 4  # GPU (or auto_k off): the verify of a few rows costs about one decode step there
MAX_AUTO_K = 5
STEP_OVERHEAD = 1.0  # the per-step rest of a CPU forward, x the one-row linears (Xeon: 35 vs 40 ms, AR step 75 ms)
_AUTO_K: dict[str, int] = {}  # model path -> K chosen (the probe runs once per launch)
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
        k = resolved_k(server_args)
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


def resolved_k(server_args) -> int:
    """K from --speculative-num-steps; else --speculative-num-draft-tokens - 1 (the chain width given);
    else ``default_k``."""
    n = getattr(server_args, "speculative_num_draft_tokens", None)
    if server_args.speculative_num_steps:
        return server_args.speculative_num_steps
    return n - 1 if isinstance(n, int) and n >= 2 else default_k(server_args)


def default_k(server_args, env=None) -> int:
    """K when --speculative-num-steps is not given.  On the CPU engine: measured (the target's few-row linear
    costs on this CPU, sglang_ssd/cpu/row_cost_probe.py) and chosen by the predicted speedup E(K) t(1) / t(K+1)
    (sglang_ssd/saguaro/k_choice.py) with the config's alpha_prior; elsewhere, or with auto_k false, DEFAULT_K."""
    env = os.environ if env is None else env
    extra = load_env_config(env)
    fan_out = extra.get("fan_out")
    if isinstance(fan_out, list) and fan_out:
        return len(fan_out) - 1  # a per-depth fan-out list already says K
    if extra.get("auto_k", True) is not True or env.get("SGLANG_USE_CPU_ENGINE") != "1":
        return DEFAULT_K
    alpha = check_alpha_prior(extra.get("alpha_prior", SaguaroConfig.alpha_prior))
    path = str(getattr(server_args, "model_path", "") or "")
    if path not in _AUTO_K:
        from sglang_ssd.cpu.row_cost_probe import probe_target
        from sglang_ssd.saguaro.k_choice import choose_k

        costs = probe_target(path, range(1, MAX_AUTO_K + 2), env)
        if costs is None:
            _AUTO_K[path] = DEFAULT_K
        else:
            k, table = choose_k(costs, alpha, STEP_OVERHEAD * costs[1], MAX_AUTO_K)
            logger.info("saguaro auto K = %d (%s not given): the target's linears over m rows cost %s ms on this "
                        "CPU; predicted speedup by K at alpha %.2f: %s", k, K_FLAG,
                        {m: round(c, 1) for m, c in costs.items()}, alpha, {j: round(v, 3) for j, v in table.items()})
            _AUTO_K[path] = k
    return _AUTO_K[path]


def _cuda_target(server_args) -> bool:
    import torch

    return getattr(server_args, "device", None) in (None, "cuda") and torch.cuda.is_available()


def validate_server_args(server_args) -> None:
    """Runs at launch, before any process starts: parse and validate the whole saguaro config."""
    cfg = SaguaroConfig.from_sources(server_args.speculative_draft_model_path,
                                     resolved_k(server_args))
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
