"""Prompt lookup inside the neural draft.  Greedy rows: copy the n-gram continuation instead of the
draft's argmax when the context's suffix recurs (n >= min_n) and the draft is unsure (top prob < max_p).
Sampled rows: draw from the mixture q' = (1 - w) q + w onehot(copy) when the suffix recurs (n >= min_n),
and send q' as the proposal.

Why it pays (issue 15): a small target's greedy answers repeat their prompt and themselves, and a 2-layer
draft copies less reliably than a lookup does.  Measured with the default draft (eighth pass) and the
request's n-gram index (n <= 4), along target-greedy answers:
  - 20 held-out prompts (1,087 positions): alpha 0.5005 -> 0.535 (chat 0.37 -> 0.39, code 0.55 -> 0.66,
    factual 0.43 -> 0.44, math 0.71 -> 0.69), E of the K = 3 chain 1.94 -> 2.08;
  - answers the draft never saw (third diverse pool, T = 0 jobs, 411 answers, 31k positions): alpha
    0.460 -> 0.587, E 1.80 -> 2.27.
(min_n, max_p) from 1 to 6 and 0.2 to 1 were compared on the second set: n = 1 copies too often (0.46 at
max_p = 1), and a confident draft (top prob >= 0.8) is right more often than the copy.

Sampled rows (T = 1 on the held-out trajectories, sum_x min(p, q')): 0.474 -> 0.497 at (2, w = 0.5), 0.500 at
w = 0.7, 0.491 at w = 0.3; n >= 1 peaks at 0.482 (w = 0.2), n >= 3 / 4 stay below n >= 2.  Through the server
it did not carry over (T = 1, b = 1, all 64 bench prompts, results/variants_sampled_lookup_b1_all.md: accept
length SD 1.658 -> 1.625, SSD 1.594 -> 1.602; the held-out trajectories are greedy ones, more repetitive than
sampled answers), so the mixture is OFF by default (SGLANG_SSD_SAMPLED_LOOKUP=on or MIN_N,W turns it on).

The corpus rule (datastore.py: the target's usual continuation of long n-grams, from its own answers) acts on
greedy rows the rule above left alone, when the draft's top probability is below MAX_P
(SGLANG_SSD_CORPUS_LOOKUP=off | on | MAX_P).

Exactness: a greedy row is verified by token equality with the target's argmax, so any proposed token
keeps the output identical to plain decoding.  A sampled row's token is a draw from the mixture q', and
q' (quantised like every q) is what travels to the verifier: speculative sampling is exact for any q it
is given the true law of.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from sglang_ssd.saguaro.datastore import MAX_P

LOOKUP_ENV = "SGLANG_SSD_GREEDY_LOOKUP"   # "off", or "MIN_N,MAX_P" (default below)
LOOKUP_MIN_N, LOOKUP_MAX_P = 2, 0.8
MIX_ENV = "SGLANG_SSD_SAMPLED_LOOKUP"     # unset / "off" (default), "on" = the values below, or "MIN_N,W"
MIX_MIN_N, MIX_W = 2, 0.5
CORPUS_ENV = "SGLANG_SSD_CORPUS_LOOKUP"   # "off", "on" (default: datastore.MAX_P) or "MAX_P" (datastore.py)


def _parse(raw: Optional[str], env: str, default: tuple[int, float], what: str,
           unset_on: bool = True) -> Optional[tuple[int, float]]:
    if raw is None or raw.strip() == "":
        return default if unset_on else None
    raw = raw.strip().lower()
    if raw in ("on", "default"):
        return default
    if raw in ("off", "0", "none"):
        return None
    try:
        a, b = raw.split(",")
        min_n, x = int(a), float(b)
    except ValueError:
        raise ValueError(f"{env}={raw!r}: expected off or MIN_N,{what} (e.g. {default[0]},{default[1]})") from None
    if min_n < 1 or not 0.0 < x <= 1.0 + 1e-9:
        raise ValueError(f"{env}={raw!r}: need MIN_N >= 1 and 0 < {what} <= 1")
    return min_n, x


def parse_lookup(raw: Optional[str]) -> Optional[tuple[int, float]]:
    """The greedy rule's env setting -> (min_n, max_p), or None when off.  ValueError on a malformed value."""
    return _parse(raw, LOOKUP_ENV, (LOOKUP_MIN_N, LOOKUP_MAX_P), "MAX_P")


def parse_mix(raw: Optional[str]) -> Optional[tuple[int, float]]:
    """The sampled rule's env setting -> (min_n, w), or None when off (the default: unset = off, "on" =
    (MIX_MIN_N, MIX_W)).  ValueError on a malformed value."""
    return _parse(raw, MIX_ENV, (MIX_MIN_N, MIX_W), "W", unset_on=False)


def parse_corpus(raw: Optional[str]) -> Optional[float]:
    """The corpus rule's env setting -> max_p (the draft's top probability below which a greedy token
    yields to the datastore's continuation), or None when off.  Unset / "on" = datastore.MAX_P."""
    if raw is None or raw.strip().lower() in ("", "on", "default"):
        return MAX_P
    raw = raw.strip().lower()
    if raw in ("off", "0", "none"):
        return None
    try:
        max_p = float(raw)
    except ValueError:
        raise ValueError(f"{CORPUS_ENV}={raw!r}: expected on, off or MAX_P (e.g. {MAX_P})") from None
    if not 0.0 < max_p <= 1.0 + 1e-9:
        raise ValueError(f"{CORPUS_ENV}={raw!r}: need 0 < MAX_P <= 1")
    return max_p


def corpus_from_env() -> Optional[float]:
    return parse_corpus(os.environ.get(CORPUS_ENV))


def lookup_from_env() -> Optional[tuple[int, float]]:
    return parse_lookup(os.environ.get(LOOKUP_ENV))


def mix_from_env() -> Optional[tuple[int, float]]:
    return parse_mix(os.environ.get(MIX_ENV))


def take_copy(match_n: torch.Tensor, top_p: torch.Tensor, min_n: int, max_p: float) -> torch.Tensor:
    """bool [n]: rows whose token becomes the copy (match of length >= min_n, draft top prob < max_p;
    max_p = 1 copies whenever the match is long enough)."""
    return (match_n >= min_n) & ((top_p < max_p) | (max_p >= 1.0))


def mix_copy(probs: torch.Tensor, cols: torch.Tensor, w: float) -> torch.Tensor:
    """probs [n, W] (rows sum to 1), cols [n] long: the copy's column per row, -1 = none -> (1 - w) probs + w
    onehot(cols) on the rows with a copy (the others unchanged)."""
    rows = (cols >= 0).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return probs
    out = probs.clone()
    out[rows] = probs[rows] * (1.0 - w)
    out[rows, cols[rows]] += w
    return out
