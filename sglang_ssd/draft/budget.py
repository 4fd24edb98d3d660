"""How much cache to build: scale the fan-outs so a build fits in the time the target's verify leaves.

The fitted fan-outs (Theorem 12) fix the branches per request; the build's cost grows with the batch,
while the window it has -- from the reply leaving to the next Speculate arriving, i.e. the target's
verify -- grows much more slowly.  Past some batch size a full build no longer fits: the next Speculate
then finds the build mid-forward and waits for that chunk (build.py cuts it there), and the entries it
was building are short or missing.  The controller keeps the build inside the window instead:

    after a cut build:                       scale <- max(scale * SHRINK, MIN_SCALE)
    after a build done in < SLACK * window:  scale <- min(scale * GROW, 1)

and the build forks round(F_j * scale) (at least one where F_j > 0) at glue index j.  At small batch the
build fits and the scale stays 1 (the fitted schedule, unchanged).  Disable with
SGLANG_SSD_BUILD_BUDGET=0 (always the full fan-outs).
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang_ssd.config import env_flag

ENV = "SGLANG_SSD_BUILD_BUDGET"
SHRINK, GROW, SLACK, MIN_SCALE = 0.8, 1.1, 0.7, 1 / 16
WINDOW_EMA = 0.2


def enabled_by_env() -> bool:
    return env_flag(ENV, True)


class BuildBudget:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.scale = 1.0
        self.window_s: Optional[float] = None   # EMA of reply -> next Speculate
        self.shrinks = self.grows = 0

    def observe_window(self, window_s: float) -> None:
        if window_s > 0:
            self.window_s = window_s if self.window_s is None else (
                (1 - WINDOW_EMA) * self.window_s + WINDOW_EMA * window_s)

    def built(self, cut: bool, build_s: float) -> None:
        if not self.enabled:
            return
        if cut:
            new = max(self.scale * SHRINK, MIN_SCALE)
            self.shrinks += int(new < self.scale)
            self.scale = new
        elif self.window_s is not None and build_s < SLACK * self.window_s and self.scale < 1:
            self.scale = min(self.scale * GROW, 1.0)
            self.grows += 1

    def fan(self, fan: Sequence[int]) -> list[int]:
        """The fan-outs to build now: F_j scaled, at least 1 where F_j > 0."""
        if self.scale >= 1:
            return list(fan)
        return [max(1, round(f * self.scale)) if f > 0 else 0 for f in fan]

    def report(self) -> dict:
        return {"build_scale": self.scale, "build_scale_shrinks": self.shrinks, "build_scale_grows": self.grows}
