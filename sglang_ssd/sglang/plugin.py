"""Entry point (group ``sglang.srt.plugins``): registers SAGUARO with SGLang, idempotently.

SGLang calls ``register()`` in every process it starts (launcher, scheduler, detokenizer), then
applies the hooks registered here.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative import spec_registry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_ssd.sglang import hooks
    from sglang_ssd.sglang.spec_algo import ALGO_NAME, SaguaroAlgo, validate_server_args, worker_factory

    if spec_registry.get_spec(ALGO_NAME) is None:  # survives a module reload
        SpeculativeAlgorithm.register(
            ALGO_NAME, supports_overlap=False, validate_server_args=validate_server_args,
            spec_class=SaguaroAlgo,
        )(worker_factory)
    HookRegistry.register(hooks.ALIAS_TARGET, hooks.validate_before_alias, HookType.AROUND)
    HookRegistry.register(hooks.TORCH_NATIVE_EXTEND, hooks.torch_native_chain_verify, HookType.AROUND)
    HookRegistry.register(hooks.DUMMY_VERIFY_INPUT, hooks.chain_verify_dummy_input, HookType.AROUND)
    import torch

    from sglang_ssd.sglang import forward_timing

    from sglang_ssd.sglang import cpu_linear

    if cpu_linear.enabled():  # few-row fp32 matmuls (a chain verify's K+1 rows) as W @ x^T on CPU
        HookRegistry.register(cpu_linear.LINEAR_APPLY, cpu_linear.linear_apply, HookType.AROUND)
        HookRegistry.register(cpu_linear.LM_HEAD, cpu_linear.compute_lm_head, HookType.AROUND)
    if forward_timing.enabled():  # benchmarks only (scripts/bench_verify.py)
        HookRegistry.register(forward_timing.MODEL_RUNNER_FORWARD, forward_timing.timed_forward, HookType.AROUND)
    if torch.cuda.is_available():  # the CUDA-graph runner module is not importable on the CPU recipe
        HookRegistry.register(hooks.GRAPH_SPEC_INFO, hooks.chain_verify_graph_spec_info, HookType.AROUND)
    _registered = True
    logger.debug("sglang-ssd: registered speculative algorithm %s", ALGO_NAME)
