"""Live cache topology: the Theorem-12 fan-out schedules fitted to this server's own traffic.

With ``fan_out_auto`` the session's fan-outs are not fixed: every verified row tells the planner how
many drafts were accepted (k), whether the verified speculation came from the cache ("primary") or
the backup, and whether the next lookup hit in the cache that had been built with F guesses at k.
FanOutPlanner (saguaro/estimator.py) re-fits the acceptance rate a and the miss exponent r every
`refresh_every` rows and re-plans a capped geometric schedule with the same budget B; the engine
then builds caches (and picks Saguaro sampling's F) with the new F^p / F^b.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from sglang_ssd.config import env_flag
from sglang_ssd.draft.state import RequestState
from sglang_ssd.saguaro.estimator import FanOutPlanner

logger = logging.getLogger(__name__)


BY_WIDTH_ENV = "SGLANG_SSD_FAN_OUT_BY_WIDTH"  # 0: the behaviour before it (for A/B runs): see LiveFanOut


class LiveFanOut:
    """by_width (default; SGLANG_SSD_FAN_OUT_BY_WIDTH=0 turns it off): rows of speculations shorter than K
    (the worker's batch-size-aware k: at b >= 3 on the CPU pair every row) feed the fit, with their length
    as the acceptance cap, and a verify of d < K drafts gets its own plan over its d + 1 outcomes
    (``schedule_for``).  Off: those rows are skipped and a short verify takes the K-plan's first entries."""

    def __init__(self, budget: int, k: int, refresh_every: int = 64, by_width: Optional[bool] = None):
        self.k = k
        self.by_width = env_flag(BY_WIDTH_ENV, True) if by_width is None else by_width
        self.planner = FanOutPlanner(budget, k, refresh_every=refresh_every)
        self._seen = 0

    def schedules(self) -> tuple[list[int], list[int]]:
        return self.planner.schedules()

    def schedule_for(self, from_cache: bool, k: int) -> list[int]:
        return self.planner.schedule_for(from_cache, k)

    def observe(self, states: Sequence[RequestState], ks: Sequence[int], hits: Sequence[Optional[bool]]) -> bool:
        """One round's rows (before the states advance); True if the schedules changed."""
        before = self.schedules()
        for st, k, hit in zip(states, ks, hits):
            if k < 0 or not st.last_spec or k > len(st.last_spec) or (len(st.last_spec) < self.k
                                                                      and not self.by_width):
                continue  # no speculation (round 0, a target-only round) or an outcome it cannot have had
            # a speculation of m < K drafts (the worker verifying k < K at this batch size, a cut build):
            # k < m is a rejection, k = m a censored run of accepts (the estimator's cap)
            fan = st.cache_fan[k] if (hit is not None and st.cache_fan and k < len(st.cache_fan)) else None
            self.planner.observe(k, st.last_hit, None if fan is None else hit, fan, cap=len(st.last_spec))
        changed = self.schedules() != before
        if changed:
            p, b = self.schedules()
            logger.info("fan-out re-planned from %d rows: primary %s backup %s", self.planner.observations, p, b)
        return changed

    def report(self) -> dict[str, float]:
        """Flat numbers for the health reply: fitted a, r, schedules, predicted / measured hit rates."""
        rep, out = self.planner.report(), {"fanout_observations": float(self.planner.observations)}
        for src in ("primary", "backup"):
            r = rep[src]
            out.update({f"fanout_{src}_a": r["a"], f"fanout_{src}_r": r["r"],
                        f"fanout_{src}_predicted_hit": r["predicted_hit_rate"],
                        f"fanout_{src}_measured_hit": -1.0 if r["measured_hit_rate"] is None else r["measured_hit_rate"]})
            out.update({f"fanout_{src}_F{j}": float(f) for j, f in enumerate(r["fan_out"])})
        return out
