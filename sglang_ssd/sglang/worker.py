"""SaguaroWorker: SGLang's speculative worker for SSD (V2 schema, synchronous scheduler).

One decode round, in order (see ``_decode``):
  1. tell the draft process the outcome of last round's proposal (k accepted, bonus) and get
     this round's K tokens (a cache hit when the draft predicted the outcome, else its backup);
  2. verify the chain [root, d_1..d_K] with ONE target forward (TARGET_VERIFY);
  3. accept exactly (greedy: argmax match; T > 0: rejection sampling against the proposal's
     true distribution q, residual max(0, p - q));
  4. hand SGLang accept_lens (incl. the bonus) and the committed tokens.
While the target runs step 2, the draft (in its own process) pre-computes the next round's
speculations for the outcomes it expects: that is what takes drafting off the critical path.
For an EAGLE-3 draft the target's forwards also capture its hidden states at the draft's layers; the
committed positions' rows go to the draft with the next round's outcome (target_features.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Optional

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from sglang_ssd.config import SaguaroConfig, resolve_draft_device
from sglang_ssd.saguaro.target_dist import is_greedy, needs_filter, sampler_filter_order, target_probs
from sglang_ssd.saguaro.verify import verify_chain, verify_chain_greedy, verify_chain_logits
from sglang_ssd.sglang import early_prefill
from sglang_ssd.sglang.compat import resolved_args
from sglang_ssd.sglang.draft_link import DraftLink
from sglang_ssd.sglang.grammar import mask_chain_logits
from sglang_ssd.sglang.metrics import SaguaroMetrics
from sglang_ssd.sglang.round_k import WARM_BATCH, RoundK
from sglang_ssd.sglang.target_features import enable_capture
from sglang_ssd.sglang.verify_input import build_chain_verify_input, verify_reads_mask

logger = logging.getLogger(__name__)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # what sglang_ssd is under


def sampling_backend(server_args) -> str:
    """The backend SGLang's Sampler runs (it reads the same config bag; "pytorch" on the CPU recipe)."""
    try:
        from sglang.srt.runtime_context import get_exec

        backend = get_exec().kernel.sampling_backend
    except (ImportError, AttributeError, ValueError):  # context not published (a worker built in a test)
        backend = None
    return backend or getattr(server_args, "sampling_backend", None) or "pytorch"


def target_gpus(server_args, gpu_id: int) -> set[int]:
    """The GPU ids the target's model runners use: base_gpu_id + i * gpu_id_step per TP x PP rank."""
    base, step = getattr(server_args, "base_gpu_id", 0) or 0, getattr(server_args, "gpu_id_step", 1) or 1
    ranks = (getattr(server_args, "tp_size", 1) or 1) * (getattr(server_args, "pp_size", 1) or 1)
    return {base + i * step for i in range(ranks)} | {gpu_id}


class SaguaroWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **kwargs):
        super().__init__()
        server_args = resolved_args(server_args)  # K, K+1 as resolved at launch (raw fields keep the input)
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.cfg = SaguaroConfig.from_server_args(server_args)
        self.k = self.cfg.num_spec_tokens
        self.n = self.k + 1  # chain width: root + K drafts
        self.device_is_gpu = torch.device(self.device).type != "cpu"
        # the distribution verification preserves is the one SGLang's sampler would draw from
        self.sampling_backend = sampling_backend(server_args)
        sampler_filter_order(self.sampling_backend, need_min_p=False)  # an unsupported backend fails here
        self.verify_reads_mask = self.device_is_gpu and verify_reads_mask(getattr(self.model_runner, "attn_backend", None))
        if self.cfg.target_cpu_core is not None and str(self.device) == "cpu":
            os.sched_setaffinity(0, {self.cfg.target_cpu_core})
        self.vocab_size = self.model_runner.model_config.vocab_size
        eos = getattr(self.model_runner.model_config.hf_config, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        n_gpus = torch.cuda.device_count() if self.device_is_gpu else 0
        self.cfg.draft_device, why = resolve_draft_device(self.cfg.draft_device, str(self.device),
                                                          target_gpus(server_args, gpu_id), n_gpus)
        (logger.warning if "SHARES" in why else logger.info)("saguaro draft device %s: %s", self.cfg.draft_device, why)
        self.link = DraftLink(self.cfg, self.vocab_size, eos_ids, device=self.device)
        self.features = self.link.features  # an EAGLE-3 draft: the target's features go with each Speculate
        # the target's forwards capture hidden states only for such a draft (FULL: every position run)
        self.capture = CaptureHiddenMode.FULL if self.features.enabled else None
        if self.features.enabled:
            enable_capture(self.model_runner.model, self.features.layers, self.features.dim)
        # batch-size-aware K (CPU engine): not with logprobs or EAGLE features (both read the full chain layout)
        self.round_k = RoundK(self.cfg.batch_k, self.k, self.cfg.alpha_prior, str(server_args.model_path),
                              cpu=not self.device_is_gpu and self.capture is None)
        self.round_k.warm(min(WARM_BATCH, getattr(server_args, "max_running_requests", None) or WARM_BATCH))
        self.metrics = SaguaroMetrics.maybe(server_args)  # --enable-metrics: saguaro's series on /metrics
        atexit.register(self.link.close)
        seed = server_args.random_seed if server_args.random_seed is not None else 0
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 7919)
        logger.info("saguaro worker ready: K=%d mode=%s fan_out=%s (sglang_ssd from %s)", self.k, self.cfg.mode,
                    self.cfg.fan_out, CHECKOUT)

    @property
    def draft_worker(self):
        return None  # the draft lives in its own process

    def alloc_memory_pool(self, **kwargs):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def clear_cache_pool(self):
        self.link.release(list(self.link.states))

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.link.release([rid])

    # ---- SGLang entry point -------------------------------------------------------------
    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None,
                                 pp_proxy_tensors=None) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            return self._decode(batch, on_publish, grammar_barrier)
        return self._prefill(batch, on_publish)

    def _prefill(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """Plain target prefill; the draft gets the prompts first and encodes them meanwhile (and, in
        async mode, builds round 0's speculations), so the first decode round need not wait for it."""
        if self.cfg.early_prefill:
            self.link.prefill_early(batch.reqs, self._draft_temps(batch.sampling_info)[2].tolist())
        result = self._target_worker.forward_batch_generation(batch, capture_hidden_mode=self.capture)
        if self.capture is not None:  # the prompt positions this forward ran (a chunk of a long prompt)
            self.features.from_prefill([r.rid for r in batch.reqs], list(batch.prefix_lens), list(batch.extend_lens),
                                       result.logits_output.hidden_states)
        if self.cfg.early_prefill:
            self.link.settle_early()
            done = early_prefill.finished_at_prefill(batch.reqs, result.next_token_ids.tolist(), self.link.eos_ids)
            if done:
                self.link.release(done)
        bs = len(batch.reqs)
        new_seq_lens = batch.seq_lens.clone()  # the sampled token has no KV yet
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=result.logits_output, next_token_ids=result.next_token_ids,
            can_run_cuda_graph=result.can_run_cuda_graph, accept_lens=accept_lens,
            new_seq_lens=new_seq_lens, next_draft_input=self._carry(result.next_token_ids[:, None], accept_lens, new_seq_lens),
            speculative_num_draft_tokens=self.n,
        )

    def _decode(self, batch: ScheduleBatch, on_publish, grammar_barrier=None) -> GenerationBatchResult:
        t_start = time.perf_counter()
        reqs, bs = batch.reqs, len(batch.reqs)
        info = batch.sampling_info
        temps, greedy, draft_temps = self._draft_temps(info)

        # 1. last round's outcome -> draft; this round's drafts <- draft (hit or backup).  Batch-size-aware
        # K: verify the first k <= K drafts (n = k + 1 of the K + 1 reserved slots); the draft is told k
        k_round = width = self.k if batch.return_logprob else self.round_k(bs)
        prop = self.link.speculate(reqs, draft_temps.tolist(), width=width)
        if self.round_k.cpu and not batch.return_logprob:  # no rows past what may be accepted (a fallback
            k_round = min(k_round, int(prop.max_accept.max()))  # round verifies the root alone: an AR step)
        prop, n = prop.first(k_round), k_round + 1

        # 2. one target forward over the chain [root, d_1..d_K] per request
        root = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64)
        chain_host = torch.cat([root[:, None], prop.tokens], dim=1)
        chain = chain_host.to(self.device)
        seq_lens = batch.seq_lens
        cols = seq_lens.to(torch.int64)[:, None] + torch.arange(n, device=self.device)
        # the scheduler pre-allocated and registered these n slots per request (alloc_for_spec_decode)
        batch.out_cache_loc = self.req_to_token_pool.req_to_token[batch.req_pool_indices[:, None], cols].reshape(-1).to(torch.int64)
        batch.input_ids = chain.reshape(-1)
        # flashinfer / triton read the chain's causal mask from spec_info (FULL layout); fa3 (topk 1) and
        # torch_native (our hook) verify causally without it
        batch.spec_info = build_chain_verify_input(chain, seq_lens, full_mask=self.verify_reads_mask,
                                                   seq_lens_cpu=getattr(batch, "seq_lens_cpu", None))
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        t_verify = time.perf_counter()
        result = self._target_worker.forward_batch_generation(batch, is_verify=True, capture_hidden_mode=self.capture)
        # constrained requests: row j masked by the grammar after d_1..d_j, in place (logprobs see it too)
        mask_chain_logits(batch, chain_host, result.logits_output.next_token_logits, grammar_barrier)
        logits = self._adjust_logits(result.logits_output.next_token_logits, info, n)[:, : self.vocab_size]
        logits = logits.float().view(bs, n, -1)
        t_accept = time.perf_counter()

        # 3. exact acceptance
        target_argmax = logits.argmax(dim=-1)
        if bool(greedy.all()):  # argmax match only: no target distributions, no random draws
            accept_lens, out_tokens = verify_chain_greedy(prop.tokens.to(self.device), target_argmax, logits.shape[-1],
                                                          max_accept=prop.max_accept.to(self.device))
        elif not bool((needs_filter(info.top_ks, info.top_ps, info.min_ps, logits.shape[-1]).to(self.device)
                       & ~greedy.to(self.device)).any()):
            # plain softmax(logits / T) on every sampled row: p only at the drafts and the stop row
            # (verify_chain_logits), not the [bs, K+1, V] table (~25 ms per round at b = 8 on a CPU core)
            accept_lens, out_tokens = verify_chain_logits(
                logits, temps.to(self.device), prop.tokens.to(self.device), prop.q16, greedy.to(self.device),
                target_argmax=target_argmax, generator=self.generator,
                max_accept=prop.max_accept.to(self.device), q_valid=prop.q_valid.to(self.device),
                q_sums=prop.q_sums,
            )
        else:  # top-k / top-p / min-p rows: the sampler's filtered distributions, in full
            rep = lambda t: t.reshape(-1)[:, None].expand(bs, n).reshape(-1)  # per-request -> per-position
            p = target_probs(logits.reshape(bs * n, -1), rep(temps), rep(info.top_ps.float()),
                             rep(info.top_ks), rep(info.min_ps.float()),
                             filter_order=sampler_filter_order(self.sampling_backend,
                                                               bool(info.need_min_p_sampling))).view(bs, n, -1)
            # prop.q16: the draft's float16 bytes, already on this device; verify_chain dequantises them
            # exactly as the draft did (proposal.dequantize_proposal)
            accept_lens, out_tokens = verify_chain(
                p, prop.tokens.to(self.device), prop.q16, greedy.to(self.device),
                target_argmax=target_argmax, generator=self.generator,
                max_accept=prop.max_accept.to(self.device), q_valid=prop.q_valid.to(self.device),
            )
        accept_lens = accept_lens.to(torch.int32)
        if self.round_k.active:  # batch K's acceptance fit (no host copy of accept_lens otherwise)
            self.round_k.observe((accept_lens - 1).tolist(), prop.max_accept.tolist())
        if self.capture is not None:  # features of the committed positions (root + accepted drafts)
            self.features.from_verify([r.rid for r in reqs], seq_lens.tolist(), accept_lens.tolist(),
                                      result.logits_output.hidden_states, n)
        # the outcome goes to the draft now, so its answer overlaps SGLang's work until the next round
        self.link.send_ahead(reqs, accept_lens.tolist(), out_tokens.tolist(), draft_temps.tolist(), width=width)
        t_end = time.perf_counter()
        self.link.record(accept_lens.tolist(), verify_s=t_accept - t_verify, accept_s=t_end - t_accept,
                         t_start=t_start, t_end=t_end, hits=prop.hit.tolist())
        if self.metrics is not None:
            self.metrics.observe(self.link.stats, prop.wait_s, verify_s=t_accept - t_verify, accept_s=t_end - t_accept)
        if self.link.stats.rounds % self.cfg.stats_interval == 0:
            logger.info(self.link.summary())
        if self.cfg.stats_file:
            self.link.write_stats(self.cfg.stats_file)

        # 4. results in SGLang's conventions: KV of root + accepted drafts is committed in place
        # (a chain's accepted tokens already sit in the first accept_len slots of the window)
        new_seq_lens = seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        if n < self.n:  # SGLang's layout has K + 1 columns per request whatever this round verified
            out_tokens = torch.cat([out_tokens, out_tokens.new_zeros(bs, self.n - n)], dim=1)
        next_ids = torch.where(torch.arange(self.n, device=self.device)[None, :] < accept_lens[:, None].long(),
                               out_tokens, torch.zeros_like(out_tokens)).reshape(-1)
        if batch.return_logprob:  # out token (b, j) came from logits row b * n + j: a chain layout
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, result.logits_output, next_ids, chain_stride=n)
        return GenerationBatchResult(
            logits_output=result.logits_output, next_token_ids=next_ids,
            can_run_cuda_graph=bool(getattr(result, "can_run_cuda_graph", False)),
            accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=self._carry(out_tokens, accept_lens, new_seq_lens),
            speculative_num_draft_tokens=self.n,
        )

    @staticmethod
    def _draft_temps(info):
        """-> (temperatures [bs], greedy rows [bs], what the draft samples at: 0 on greedy rows)."""
        temps = info.temperatures.reshape(-1).float()
        greedy = is_greedy(temps, info.top_ks.reshape(-1))
        return temps, greedy, torch.where(greedy, torch.zeros_like(temps), temps)

    def _adjust_logits(self, logits: torch.Tensor, info, n: int) -> torch.Tensor:
        """Penalties and logit_bias, applied to all n positions of a request the way SGLang's own
        speculative verifiers do (its "relaxed" penalties: state as of the round's start)."""
        if getattr(info, "acc_additive_penalties", None) is not None:
            logits = logits + torch.repeat_interleave(info.acc_additive_penalties, n, dim=0)
        if getattr(info, "acc_scaling_penalties", None) is not None:
            from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

            logits = logits.clone()
            apply_scaling_penalties(logits, torch.repeat_interleave(info.acc_scaling_penalties, n, dim=0))
        if getattr(info, "logit_bias", None) is not None:
            logits = logits + torch.repeat_interleave(info.logit_bias, n, dim=0)
        return logits

    def _carry(self, tokens: torch.Tensor, accept_lens: torch.Tensor, new_seq_lens: torch.Tensor):
        """What the scheduler keeps on the batch between rounds (filtered/merged with it)."""
        bs = tokens.shape[0]
        padded = torch.zeros(bs, self.n, dtype=torch.int64, device=self.device)
        padded[:, : tokens.shape[1]] = tokens
        return NgramVerifyInput(draft_token_num=self.n, new_seq_lens=new_seq_lens,
                                accept_tokens=padded.reshape(-1), accept_lens=accept_lens)
