"""The worker's side of the draft connection: process lifecycle, per-request state, fallback.

Each request's state is what the draft last proposed for it; the next round tells the draft the
outcome (k accepted, bonus) of that proposal.  Whenever the draft is unreachable, slow or
confused, ``speculate`` returns an empty proposal (``max_accept = 0``) and the round decodes
one token with the target alone: output stays exact, nothing is lost.  The draft is then
restarted (or reconnected) with backoff and live requests are re-prefilled lazily.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_ssd.config import SaguaroConfig, check_saguaro_c

logger = logging.getLogger(__name__)


@dataclass
class Proposal:
    """K draft tokens per request and what verification needs to stay exact."""

    tokens: torch.Tensor  # [bs, K] int64
    q16: Optional[torch.Tensor]  # [bs, K, V] float16 proposal distributions, rows with q only
    q_valid: torch.Tensor  # [bs] bool: row has a sampled (non-deterministic) proposal
    max_accept: torch.Tensor  # [bs] int64: drafts that may be accepted (0 = target-only round)
    hit: torch.Tensor  # [bs] bool: came from the speculation cache
    wait_s: float = 0.0


@dataclass
class _ReqState:
    spec: list[int]  # the usable tokens last proposed (K, or fewer after a cut draft build)
    known_len: int  # prompt + output tokens when the proposal was made


@dataclass
class LinkStats:
    rounds: int = 0
    rows: int = 0
    hits: int = 0
    fallback_rows: int = 0
    accepted: int = 0  # accepted drafts + bonus tokens
    wait_s: float = 0.0
    waited_rounds: int = 0  # rounds whose draft reply took longer than WAITED_S (the target waited)
    verify_s: float = 0.0  # target forward over the chains
    accept_s: float = 0.0  # target probabilities + exact acceptance
    round_s: float = 0.0  # whole decode round inside the worker (wait + verify + accept + glue)
    gap_s: float = 0.0  # scheduler time between consecutive decode rounds (idle gaps > 1 s excluded)
    answer_s: float = 0.0  # the draft's own time to answer (its reply's answer_ms: lookup + backup decode)
    backup_s: float = 0.0  # ... of which just-in-time backup decoding of missed rows
    reconnects: int = 0
    errors: int = 0
    deadline_misses: int = 0  # rounds whose drafts did not arrive within round_deadline_s
    hist: list[int] = field(default_factory=list)


def usable_drafts(tokens: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reply tokens [bs, K] -> (tokens with the -1 padding replaced by 0, max_accept [bs] int64).

    A row is d valid ids followed by K - d entries of -1 (a speculation the draft finished to depth d
    only); anything else (-1 before a valid id, other negatives, ids >= vocab) is a protocol error."""
    valid = (tokens >= 0) & (tokens < vocab_size)
    max_accept = valid.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    tail = torch.arange(tokens.shape[1])[None, :] >= max_accept[:, None]
    if not bool(((tokens == -1) == tail).all()):
        raise ValueError("draft proposed token ids outside the vocabulary")
    return torch.where(tail, torch.zeros_like(tokens), tokens), max_accept


PREFILL_S_PER_TOKEN = 0.002  # allowance per prompt token a draft prefill gets beyond the round deadline
WAITED_S = 0.005  # a reply slower than this was computed while the target waited (a ready one is ~1 ms)


class DraftLink:
    def __init__(self, cfg: SaguaroConfig, vocab_size: int, eos_ids: list[int]):
        from sglang_ssd.draft.client import DraftClient

        self._client_cls = DraftClient
        self.cfg = cfg
        self.k = cfg.num_spec_tokens
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.states: dict[str, _ReqState] = {}
        self.stats = LinkStats(hist=[0] * (self.k + 2))
        self.proc: Optional[subprocess.Popen] = None
        self.client = None
        self.round_id = 0
        self.client_ok = True  # False after an error, until a reconnect succeeds
        self._last_round_end: Optional[float] = None
        self._wait_ema = 0.0  # recent draft reply time (s), successful rounds only
        self.client_id = uuid.uuid4().hex  # stable across reconnects: the draft knows its owner by it
        self._next_retry = 0.0
        self._backoff = 1.0
        self.endpoint = cfg.draft_endpoint or f"ipc://{tempfile.gettempdir()}/sglang-ssd-{uuid.uuid4().hex[:12]}.sock"
        self.spawn = cfg.spawn_draft
        self._connect(startup=True)

    # ---- lifecycle ----------------------------------------------------------------------
    def _spawn(self) -> None:
        cmd = [sys.executable, "-m", "sglang_ssd.draft", "--model", self.cfg.draft_model_path,
               "--device", self.cfg.draft_device, "--bind", self.endpoint,
               "--dtype", self.cfg.draft_dtype, "--threads", str(self.cfg.draft_threads)]
        core = self.cfg.draft_cpu_core
        if core is None and self.cfg.draft_device == "cpu" and (os.cpu_count() or 1) > 1:
            core = (os.cpu_count() or 1) - 1
        if core is not None:
            cmd += ["--cpu-core", str(core)]
        if self.cfg.curve_keys is not None:
            cmd += ["--curve-keys", self.cfg.curve_keys]
        logger.info("saguaro: starting draft process: %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd)

    def _connect(self, startup: bool = False) -> bool:
        try:
            if self.spawn and (self.proc is None or self.proc.poll() is not None):
                self._spawn()
            if self.client is not None:
                self.client.close()
            self.client = self._client_cls(self.endpoint, timeout_s=self.cfg.draft_timeout_s,
                                           alive=self._alive if self.spawn else None,
                                           curve_keys=self.cfg.curve_keys)
            # at startup wait for the draft to load; later (serving) try once, briefly: rounds keep
            # decoding with the target alone meanwhile, and the next try comes after a backoff
            deadline = time.monotonic() + (self.cfg.startup_timeout_s if startup else 0.0)
            while True:
                try:
                    info = self.client.hello(k=self.k, mode=self.cfg.mode, fan_out=self.cfg.fan_out,
                                             client_id=self.client_id,
                                             vocab_size=self.vocab_size, eos_ids=self.eos_ids,
                                             timeout_s=None if startup else self.cfg.round_deadline_s,
                                             backup=self.cfg.backup,
                                             fan_out_auto=self.cfg.fan_out_auto)
                    break
                except Exception as exc:  # not up yet
                    if self.proc is not None and self.proc.poll() is not None:
                        raise RuntimeError(f"draft process exited with code {self.proc.returncode}") from exc
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            logger.info("saguaro: draft ready at %s (%s)", self.endpoint, info)
            self.states.clear()
            self._backoff = 1.0
            if not startup:
                self.stats.reconnects += 1
            return True
        except Exception as exc:
            if startup:
                raise RuntimeError(f"saguaro: could not start the draft at {self.endpoint}: {exc}") from exc
            logger.warning("saguaro: draft reconnect failed (%s); retrying in %.0fs", exc, self._backoff)
            self._next_retry = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            return False

    def _alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def _fail(self, exc: Exception) -> None:
        self.stats.errors += 1
        self.stats.deadline_misses += int(isinstance(exc, TimeoutError))
        logger.warning("saguaro: draft error (%s: %s); this round decodes with the target alone",
                       type(exc).__name__, exc)
        self.client_ok = False
        self.states.clear()
        self._next_retry = time.monotonic() + self._backoff

    def close(self) -> None:
        try:
            if self.client is not None and self.spawn:
                self.client.shutdown()
        except Exception:
            pass
        if self.client is not None:
            self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    # ---- per round ----------------------------------------------------------------------
    def speculate(self, reqs, temperatures: list[float]) -> Proposal:
        bs = len(reqs)
        t0 = time.perf_counter()
        if not self.client_ok:
            if time.monotonic() < self._next_retry or not self._connect():
                return self._fallback(bs, t0)
            self.client_ok = True
        rids = [r.rid for r in reqs]
        try:
            if self.spawn and not self._alive():
                raise RuntimeError(f"draft process exited with code {self.proc.returncode}")
            self._release_departed(set(rids))
            ks, bonuses, new_rids, new_prompts, new_temps, new_cs = [], [], [], [], [], []
            for r, temp in zip(reqs, temperatures):
                known = len(r.origin_input_ids) + len(r.output_ids)
                st = self.states.get(r.rid)
                k = self._outcome(st, r, known)
                if k is None:  # unknown to the draft (new, retracted, or after a restart)
                    if st is not None:
                        self.client.release([r.rid], timeout_s=self.cfg.round_deadline_s)
                    new_rids.append(r.rid)
                    new_prompts.append(list(r.origin_input_ids) + list(r.output_ids[:-1]))
                    new_temps.append(temp)
                    new_cs.append(self._saguaro_c(r))
                    k = -1
                ks.append(k)
                bonuses.append(int(r.output_ids[-1]))
            if new_rids:
                # prefill may take longer than a round (long prompts): the deadline grows with the
                # tokens to encode, so a hung draft still cannot hold the target for long
                n_tok = sum(len(x) for x in new_prompts)
                self.client.prefill(new_rids, new_prompts, new_temps, saguaro_c=new_cs,
                                    timeout_s=self.cfg.round_deadline_s + n_tok * PREFILL_S_PER_TOKEN)
            self.round_id += 1
            # the round's deadline bounds the target's wait: a hung or stopped draft costs one
            # deadline, then rounds decode target-only until a (briefly tried) reconnect succeeds
            reply = self.client.speculate(self.round_id, rids, ks, bonuses, temperatures,
                                          timeout_s=self._deadline())
            tokens, max_accept = usable_drafts(
                torch.as_tensor(reply.tokens, dtype=torch.int64).reshape(bs, self.k), self.vocab_size)
            q_rows = torch.as_tensor(reply.q_rows, dtype=torch.int64)
            q_valid = torch.zeros(bs, dtype=torch.bool)
            q_valid[q_rows] = True
            q16 = None
            if q_rows.numel():
                if tuple(reply.q.shape) != (q_rows.numel(), self.k, self.vocab_size):
                    raise ValueError(f"draft sent q of shape {tuple(reply.q.shape)}")
                q16 = torch.zeros(bs, self.k, self.vocab_size, dtype=torch.float16)
                q16[q_rows] = torch.from_numpy(reply.q)
            for r, row, n in zip(reqs, tokens.tolist(), max_accept.tolist()):  # only what may be accepted
                self.states[r.rid] = _ReqState(spec=row[:n], known_len=len(r.origin_input_ids) + len(r.output_ids))
            hit = torch.as_tensor(reply.hit, dtype=torch.bool).reshape(bs)
        except Exception as exc:
            self._fail(exc)
            return self._fallback(bs, t0)
        wait = time.perf_counter() - t0
        self._wait_ema = 0.9 * self._wait_ema + 0.1 * wait
        self.stats.wait_s += wait
        self.stats.waited_rounds += int(wait > WAITED_S)
        self.stats.answer_s += reply.answer_ms / 1e3
        self.stats.backup_s += reply.backup_ms / 1e3
        self.stats.hits += int(hit.sum())
        return Proposal(tokens, q16, q_valid, max_accept, hit, wait)

    def _deadline(self) -> float:
        """The round's wait bound: round_deadline_s, stretched to 5x the recent reply time so a big
        batch whose drafts legitimately take longer is not cut off (a hung draft still is)."""
        return max(self.cfg.round_deadline_s, 5.0 * self._wait_ema)

    def _saguaro_c(self, req) -> float:
        """Per-request Saguaro sampling C: sampling_params.custom_params["saguaro_c"], else the server's."""
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
        if "saguaro_c" not in custom:
            return self.cfg.saguaro_c
        c = check_saguaro_c(custom["saguaro_c"])
        if c is None:
            logger.warning("request %s: custom_params saguaro_c=%r is not in (0, 1]; using the server's %.3g",
                           req.rid, custom["saguaro_c"], self.cfg.saguaro_c)
            return self.cfg.saguaro_c
        return c

    def _outcome(self, st: Optional[_ReqState], req, known: int) -> Optional[int]:
        """k for the last proposal, checked against what SGLang committed; None = out of sync."""
        if st is None:
            return None
        k = known - st.known_len - 1  # the round added k accepted drafts + 1 bonus
        if not 0 <= k <= len(st.spec) or list(req.output_ids[len(req.output_ids) - 1 - k : -1]) != st.spec[:k]:
            return None
        return k

    def _release_departed(self, live: set) -> None:
        gone = [rid for rid in self.states if rid not in live]
        if gone:
            self.client.release(gone, timeout_s=self.cfg.round_deadline_s)
            for rid in gone:
                del self.states[rid]

    def release(self, rids: list[str]) -> None:
        rids = [r for r in rids if r in self.states]
        if not rids or not self.client_ok:
            return
        try:
            self.client.release(rids, timeout_s=self.cfg.round_deadline_s)
            for rid in rids:
                del self.states[rid]
        except Exception as exc:
            self._fail(exc)

    def _fallback(self, bs: int, t0: float) -> Proposal:
        self.stats.fallback_rows += bs
        return Proposal(
            tokens=torch.zeros(bs, self.k, dtype=torch.int64), q16=None,
            q_valid=torch.zeros(bs, dtype=torch.bool), max_accept=torch.zeros(bs, dtype=torch.int64),
            hit=torch.zeros(bs, dtype=torch.bool), wait_s=time.perf_counter() - t0)

    def record(self, accept_lens: list[int], verify_s: float = 0.0, accept_s: float = 0.0,
               t_start: Optional[float] = None, t_end: Optional[float] = None) -> None:
        """One verified round: accepted lengths and where its time went (perf_counter stamps)."""
        s = self.stats
        s.verify_s += verify_s
        s.accept_s += accept_s
        if t_start is not None and t_end is not None:
            s.round_s += t_end - t_start
            last = self._last_round_end
            if last is not None and 0 <= t_start - last < 1.0:
                s.gap_s += t_start - last
            self._last_round_end = t_end
        self.stats.rounds += 1
        self.stats.rows += len(accept_lens)
        self.stats.accepted += sum(accept_lens)
        for a in accept_lens:
            self.stats.hist[min(a, self.k + 1)] += 1

    def as_dict(self) -> dict:
        s = self.stats
        rows = max(s.rows, 1)
        return {"mode": self.cfg.mode, "k": self.k, "fan_out": self.cfg.fan_out, "rounds": s.rounds,
                "rows": s.rows, "hits": s.hits, "hit_rate": s.hits / rows, "accept_len": s.accepted / rows,
                "draft_wait_ms": 1000 * s.wait_s / max(s.rounds, 1), "fallback_rows": s.fallback_rows,
                "waited_rounds": s.waited_rounds, "wait_s": s.wait_s, "verify_s": s.verify_s,
                "accept_s": s.accept_s, "round_s": s.round_s, "gap_s": s.gap_s, "answer_s": s.answer_s,
                "backup_s": s.backup_s,
                "errors": s.errors, "reconnects": s.reconnects, "deadline_misses": s.deadline_misses,
                "accept_hist": s.hist}

    def write_stats(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.as_dict(), fh)
        os.replace(tmp, path)

    def summary(self) -> str:
        s = self.stats
        rows = max(s.rows, 1)
        return (f"saguaro[{self.cfg.mode}] rounds={s.rounds} accept_len={s.accepted / rows:.2f} "
                f"hit_rate={s.hits / rows:.2f} draft_wait_ms={1000 * s.wait_s / max(s.rounds, 1):.1f} "
                f"fallback_rows={s.fallback_rows} errors={s.errors} accept_hist={s.hist}")
