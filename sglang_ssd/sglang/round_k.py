"""Batch-size-aware K (config ``batch_k``, CPU engine): how many of the K drafts a round verifies.

SGLang fixes K at launch (the scheduler reserves K + 1 KV slots per request and round), and auto K picks
it for one request.  But a round of b requests runs the target's linears over b * (k + 1) rows where AR
runs them over b rows, and on a CPU core that cost is flat for a few rows and then grows (oneDNN-packed
weights: ~0.6-0.9x a one-row F.linear up to 8 rows, ~1.2x at 16, ~2x at 32 on an AMD EPYC,
results/small_m_linear_packed_amd.md): K = 3 pays at b = 1 and costs 2x an AR step at b = 8.  So each
round verifies only the first k <= K drafts of every chain, k chosen per batch size by the predicted
speedup with the target's measured row costs (``k_choice.choose_round_k``); the rest of the reserved
slots stay unused.  Exact: a chain's first k drafts, verified against their own q, are the same rule on
fewer rows (``Proposal.first``).

    batch_k: true    measured per batch size of 2 or more: sizes 2 .. WARM_BATCH when the worker starts,
                     a larger size in its first round (a probe of its row counts, ~1-3 s, unless this
                     machine measured them before: row_cost_probe's disk cache); one request verifies K
                     (default)
             false   every round verifies K
             N       at most N drafts per round (a fixed cap)
"""

from __future__ import annotations

import logging

from sglang_ssd.saguaro.estimator import AcceptanceEstimator

logger = logging.getLogger(__name__)
WARM_BATCH = 8  # batch sizes 2 .. this are chosen at start-up, not in a live round
REFIT_ROWS = 256  # verified rows between fits of the acceptance rate
REFIT_DELTA = 0.03  # k is chosen again when the fitted acceptance moved this much


class RoundK:
    def __init__(self, batch_k, k: int, alpha: float, model_path: str, cpu: bool):
        self.mode, self.k, self.alpha, self.path, self.cpu = batch_k, k, alpha, model_path, cpu
        self.by_bs: dict[int, int] = {}
        self.costs: dict[int, float] = {}  # M rows -> ms of the target's linears (probe)
        # the acceptance fit (accepted / (accepted + rejections), recent rows weigh more), no prior pseudo-counts
        self.fit = AcceptanceEstimator(max(k, 1), prior_a=alpha, prior_weight=0.0, half_life=REFIT_ROWS)
        self._rows = 0  # rows since the last fit

    @property
    def active(self) -> bool:
        return self.mode is not False and self.cpu and self.k > 1

    def __call__(self, bs: int) -> int:
        if not self.active:
            return self.k
        if self.mode is not True:  # an integer cap
            return max(1, min(int(self.mode), self.k))
        if bs == 1:  # K is the one-request choice (auto K's, or the user's): batch K only lowers it for more
            return self.k
        if bs not in self.by_bs:
            self.by_bs[bs] = self._choose(bs)
        return self.by_bs[bs]

    def warm(self, max_bs: int = WARM_BATCH) -> None:
        """Choose k for batch sizes 2 .. max_bs now (one probe of all their row counts, or the disk cache)."""
        if not self.active or self.mode is not True or max_bs < 2:
            return
        self._measure({1, *(bs * (j + 1) for bs in range(2, max_bs + 1) for j in range(self.k + 1))})
        for bs in range(2, max_bs + 1):
            self(bs)

    def _measure(self, rows) -> bool:
        from sglang_ssd.cpu.row_cost_probe import probe_target

        need = sorted(set(rows) - set(self.costs))
        if need:
            got = probe_target(self.path, need)
            if got is None:
                return False
            self.costs.update(got)
        return True

    def observe(self, accepted, offered) -> None:
        """One round's rows: drafts accepted of the drafts verified.  The acceptance rate the choice
        assumes starts at alpha_prior and is then fitted to this server's traffic every REFIT_ROWS rows
        (the geometric law's estimate accepted / (accepted + rejections): a row that accepted all it was
        offered has no rejection); k is chosen again for the sizes seen when it moved by REFIT_DELTA."""
        if not self.active or self.mode is not True:
            return
        for a, n in zip(accepted, offered):
            if n > 0:  # a target-only row (max_accept 0) says nothing
                self.fit.observe(a, True, cap=n)
                self._rows += 1
        if self._rows < REFIT_ROWS:
            return
        fitted, self._rows = self.fit.estimate(True), 0
        if abs(fitted - self.alpha) < REFIT_DELTA:
            return
        logger.info("saguaro batch K: acceptance fitted %.3f (was %.3f): k chosen again", fitted, self.alpha)
        self.alpha = min(fitted, 0.99)
        for bs in list(self.by_bs):  # their row costs are measured already: no probe
            self.by_bs[bs] = self._choose(bs)

    def cost(self, m: int) -> float:
        """ms of m rows: the least measured cost of m or more rows (m rows never cost more than m' > m, which
        could compute them padded), so one disturbed timing cannot make a row count look prohibitive."""
        return min(c for r, c in self.costs.items() if r >= m)

    def _choose(self, bs: int) -> int:
        from sglang_ssd.saguaro.k_choice import choose_round_k
        from sglang_ssd.sglang.spec_algo import STEP_OVERHEAD

        if not self._measure({1, *(bs * (j + 1) for j in range(self.k + 1))}):
            return self.k
        k, table = choose_round_k(self.cost, bs, self.alpha, STEP_OVERHEAD * self.costs[1], self.k)
        logger.info("saguaro batch K: %d of K = %d drafts verified at batch %d (predicted speedup by k at alpha "
                    "%.2f: %s)", k, self.k, bs, self.alpha, {j: round(v, 3) for j, v in table.items()})
        return k
