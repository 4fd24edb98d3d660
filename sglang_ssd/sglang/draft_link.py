"""The worker's side of the draft connection: process lifecycle, per-request state, fallback.

Each request's state is what the draft last proposed for it; the next round tells the draft the
outcome (k accepted, bonus) of that proposal.  Whenever the draft is unreachable, slow or
confused, ``speculate`` returns an empty proposal (``max_accept = 0``) and the round decodes
one token with the target alone: output stays exact, nothing is lost.

A late reply (the round's deadline passed) resets nothing: the draft still processes the request,
in order, so the target-only round is recorded as the outcome "k = 0, bonus b" of the proposal it
will have made; nothing more is sent until the late reply is in (one bounded wait, then rounds do
not wait at all).  Only a broken link (dead process, error reply, bad reply, a draft silent for
draft_timeout_s) reconnects, with backoff; a Hello that resumes the draft's session keeps every
request's state, otherwise live requests are re-prefilled lazily.  Whatever the timing, a row is
only told an outcome that ``_outcome`` checked against what SGLang committed; else it is
re-prefilled (Prefill of a live rid replaces just that request).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
import uuid
from typing import Optional

import torch

from sglang_ssd.config import SaguaroConfig, check_saguaro_c, resolve_backup
from sglang_ssd.protocol import Ack, SpecReply
from sglang_ssd.sglang import ahead, early_prefill
from sglang_ssd.sglang.draft_process import draft_command
from sglang_ssd.sglang.link_state import (UNKNOWN, LinkStats, Proposal, _Late, _ReqState, assemble_proposal,
                                          usable_drafts)
from sglang_ssd.sglang.target_features import TargetFeatures

__all__ = ["DraftLink", "LinkStats", "Proposal"]

logger = logging.getLogger(__name__)


PREFILL_S_PER_TOKEN = 0.002  # allowance per prompt token a draft prefill gets beyond the round deadline
WAITED_S = 0.005  # a reply slower than this was computed while the target waited (a ready one is ~1 ms)


class DraftLink:
    def __init__(self, cfg: SaguaroConfig, vocab_size: int, eos_ids: list[int], device="cpu"):
        from sglang_ssd.draft.client import DraftClient

        self._client_cls = DraftClient
        self.cfg = cfg
        self.k = cfg.num_spec_tokens
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.device = torch.device(device)  # the verifier's: q16 is built there
        self.states: dict[str, _ReqState] = {}
        self.stats = LinkStats(hist=[0] * (self.k + 2))
        self.proc: Optional[subprocess.Popen] = None
        self.client = None
        self.round_id = 0
        self.client_ok = True  # False after a broken-link error, until a reconnect succeeds
        self._late: Optional[_Late] = None  # a request whose reply missed its deadline, still outstanding
        self._inflight: Optional[tuple] = None  # (kind, rids, knowns, round_id) of the call under way
        self._ahead: Optional[ahead.Ahead] = None  # the Speculate sent after the last verify, and its reply
        self._wait_ema = 0.0  # recent draft reply time (s), successful rounds only
        self.client_id = uuid.uuid4().hex  # stable across reconnects: the draft knows its owner by it
        self.features = TargetFeatures()  # an EAGLE-3 draft's target features, until sent
        self._next_retry = 0.0
        self._backoff = 1.0
        self.endpoint = cfg.draft_endpoint or f"ipc://{tempfile.gettempdir()}/sglang-ssd-{uuid.uuid4().hex[:12]}.sock"
        self.spawn = cfg.spawn_draft
        self._connect(startup=True)

    # ---- lifecycle ----------------------------------------------------------------------
    def _spawn(self) -> None:
        cmd = draft_command(self.cfg, self.endpoint, self.device)
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
            deadline = time.monotonic() + (self.cfg.draft_startup_timeout() if startup else 0.0)
            while True:
                try:
                    info = self.client.hello(k=self.k, mode=self.cfg.mode, fan_out=self.cfg.fan_out,
                                             client_id=self.client_id,
                                             vocab_size=self.vocab_size, eos_ids=self.eos_ids,
                                             timeout_s=None if startup else self.cfg.round_deadline_s,
                                             backup=resolve_backup(self.cfg.backup, self.cfg.draft_device,
                                                                   self.cfg.mode, self.spawn),
                                             fan_out_auto=self.cfg.fan_out_auto)
                    break
                except Exception as exc:  # not up yet
                    if self.proc is not None and self.proc.poll() is not None:
                        raise RuntimeError(f"draft process exited with code {self.proc.returncode}") from exc
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            logger.info("saguaro: draft ready at %s (%s)", self.endpoint, info)
            self._late = self._ahead = None  # a new socket: no reply to the old one will arrive
            self.features.configure(info.feature_layers, info.feature_dim)
            if not info.resumed:  # a fresh session: the draft holds nothing of ours
                self.states.clear()
            self._backoff = 1.0
            if not startup:
                self.stats.reconnects += 1
                self.stats.resumes += int(info.resumed)
                self.stats.resets += int(not info.resumed)
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
        """A broken link (dead process, error or bad reply, a draft silent too long): reconnect later.
        Rows of the failed call and of a late one are marked unknown (re-prefilled if the Hello resumes)."""
        self.stats.errors += 1
        logger.warning("saguaro: draft error (%s: %s); this round decodes with the target alone",
                       type(exc).__name__, exc)
        self.client_ok = False
        self._forget(self._inflight[1] if self._inflight else [])
        self._forget(self._late.rids if self._late else [])
        self._late = self._inflight = self._ahead = None
        self._next_retry = time.monotonic() + self._backoff

    def _forget(self, rids) -> None:
        for rid in rids:
            self.states[rid] = _ReqState(None, UNKNOWN)

    def _missed(self, exc: Exception) -> None:
        """The call under way missed its deadline: the live draft will still process it (no reset)."""
        if self._inflight is None:  # not one of our calls: nothing to account for, treat as broken
            return self._fail(exc)
        kind, rids, knowns, round_id = self._inflight
        self._inflight = None
        self.stats.deadline_misses += 1
        self._late = _Late(getattr(exc, "req_id", None) or 0, kind, list(rids), round_id, time.monotonic())
        if kind == "speculate":  # the draft will have proposed something at these lengths: k = 0 next
            for rid, known in zip(rids, knowns):
                self.states[rid] = _ReqState(None, known)
        else:  # a prefill (its rows were not speculated) or a release (acknowledged when the reply is in)
            self._forget(rids)
        logger.warning("saguaro: the draft missed the deadline of its %s (%s); this round decodes with the "
                       "target alone, the session is kept and the late reply discarded", kind, exc)

    def _settle_late(self, max_wait: float) -> bool:
        """-> True when no late reply is outstanding (any that was is now received and discarded)."""
        late = self._late
        if late is None:
            return True
        try:
            reply = self.client.recv(late.req_id, timeout_s=max_wait)
        except TimeoutError:
            silent = time.monotonic() - late.since
            if silent > self.cfg.draft_timeout_s:  # alive but silent this long: treat the link as broken
                raise RuntimeError(f"the draft has not answered its {late.kind} for {silent:.0f} s") from None
            return False
        self._late = None
        if late.kind == early_prefill.KIND:  # sent early on purpose, not late
            early_prefill.settle(self, late, reply)
            return True
        if late.kind == ahead.KIND:  # sent after the last verify for the next round: kept for it
            ahead.received(self, late, reply)
            return True
        self.stats.late_replies_discarded += 1
        if late.kind == "speculate":
            ok = isinstance(reply, SpecReply) and reply.round_id == late.round_id \
                and reply.tokens.shape[0] == len(late.rids)
            if ok:
                self.stats.replied(reply, used=False)  # its builds happened all the same
        else:
            ok = isinstance(reply, Ack)
        if not ok:  # rejected (nothing changed on the draft) or confused: those rows are re-prefilled
            logger.warning("saguaro: the late reply to a %s was a %s: %d rows will be re-prefilled",
                           late.kind, reply.TYPE, len(late.rids))
            self._forget(late.rids)
        elif late.kind == "release":
            for rid in late.rids:
                self.states.pop(rid, None)
        logger.info("saguaro: the late reply to the %s arrived after %.2f s; speculation resumes",
                    late.kind, time.monotonic() - late.since)
        return True

    def close(self) -> None:
        try:
            if self.client is not None and self.spawn:  # the process is terminated below if this fails
                self.client.shutdown(timeout_s=2.0)
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
    def speculate(self, reqs, temperatures: list[float], width: int = 0) -> Proposal:
        """This round's drafts (K per request, or ``width`` < K: the drafts the worker verifies)."""
        bs = len(reqs)
        t0 = time.perf_counter()
        if not self.client_ok:
            if time.monotonic() < self._next_retry or not self._connect():
                return self._fallback(bs, t0)
            self.client_ok = True
        rids = [r.rid for r in reqs]
        self._inflight = None
        try:
            if self.spawn and not self._alive():
                raise RuntimeError(f"draft process exited with code {self.proc.returncode}")
            # the Speculate sent right after last round's verify (ahead.py): one wait of a round deadline
            if self._late is not None and self._late.kind == ahead.KIND and not ahead.settle(self, self._deadline()):
                return self._fallback(bs, t0)
            # a late reply gets one wait of a round deadline (the next round), later rounds only look
            if self._late is not None:
                first = self._late.first_wait if self._late.first_wait is not None else self._deadline()
                wait = 0.0 if self._late.waited else first
                self._late.waited = True
                if not self._settle_late(wait):  # still busy: ask nothing, the draft would fall further behind
                    self.stats.stalled_rounds += 1
                    return self._fallback(bs, t0)
            pieces = []
            reply, pos, tokens, max_accept = ahead.take(self, reqs, self._usable)
            if reply is not None:
                pieces.append((reply, pos, tokens, max_accept))
                self.stats.ahead_rows_used += sum(p >= 0 for p in pos)
            self._release_departed(set(rids))
            covered = {p for p in pos if p >= 0}
            rest = [i for i in range(bs) if i not in covered]
            if rest:  # rows the ahead reply did not answer (or every row, without one)
                pieces.append(self._ask([reqs[i] for i in rest], [temperatures[i] for i in rest], rest, width))
            prop = assemble_proposal(bs, self.k, self.vocab_size, self.device, pieces)
            self._inflight = None
        except TimeoutError as exc:  # DraftTimeout: a live draft that is late
            self._missed(exc)
            return self._fallback(bs, t0)
        except Exception as exc:
            self._fail(exc)
            return self._fallback(bs, t0)
        wait = time.perf_counter() - t0
        self._wait_ema = 0.9 * self._wait_ema + 0.1 * wait
        self.stats.wait_s += wait
        self.stats.waited_rounds += int(wait > WAITED_S)
        for reply, *_ in pieces:
            self.stats.answer_s += reply.answer_ms / 1e3
            self.stats.backup_s += reply.backup_ms / 1e3
            self.stats.replied(reply, used=True)
        self.stats.hits += int(prop.hit.sum())
        prop.wait_s = wait
        return prop

    def _usable(self, reply: SpecReply) -> tuple[torch.Tensor, torch.Tensor]:
        m = reply.tokens.shape[0]
        return usable_drafts(torch.as_tensor(reply.tokens, dtype=torch.int64).reshape(m, self.k), self.vocab_size)

    def _ask(self, reqs, temperatures: list[float], positions: list[int], width: int = 0):
        """Prefill (rows the draft does not know) and Speculate for these rows of the batch, waiting for the
        reply (the round's deadline).  -> (reply, their batch positions, usable tokens, max_accept)."""
        rids = [r.rid for r in reqs]
        knowns = [len(r.origin_input_ids) + len(r.output_ids) for r in reqs]
        ks, bonuses, new_rids, new_prompts, new_temps, new_cs = [], [], [], [], [], []
        for r, temp, known in zip(reqs, temperatures, knowns):
            k = self._outcome(self.states.get(r.rid), r, known)
            if k is None:  # unknown to the draft (new, retracted, after a restart, out of sync)
                new_rids.append(r.rid)  # a Prefill of a live rid replaces that request
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
            self._inflight = ("prefill", new_rids, None, 0)
            self.client.prefill(new_rids, new_prompts, new_temps, saguaro_c=new_cs,
                                timeout_s=self.cfg.round_deadline_s + n_tok * PREFILL_S_PER_TOKEN)
        self.round_id += 1
        # the round's deadline bounds the target's wait: a hung or stopped draft costs one
        # deadline (and one more wait for its late reply), then rounds decode target-only at once
        self._inflight = ("speculate", rids, knowns, self.round_id)
        reply = self.client.speculate(self.round_id, rids, ks, bonuses, temperatures,
                                      timeout_s=self._deadline(),
                                      features=self.features.take(rids) if self.features.enabled else None,
                                      width=width)
        tokens, max_accept = self._usable(reply)
        for r, row, n, known in zip(reqs, tokens.tolist(), max_accept.tolist(), knowns):
            self.states[r.rid] = _ReqState(spec=row[:n], known_len=known)  # only what may be accepted
        return reply, list(positions), tokens, max_accept

    def send_ahead(self, reqs, accept_lens: list[int], out_tokens: list[list[int]],
                   temperatures: list[float], width: int = 0) -> bool:
        """Right after a verify: this round's outcome and the next Speculate, not waited for (ahead.py);
        width: the drafts per request the next round is expected to verify (0 = K)."""
        return ahead.send(self, reqs, accept_lens, out_tokens, temperatures, width)

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
        if st is None or st.known_len == UNKNOWN:
            return None
        k = known - st.known_len - 1  # the round added k accepted drafts + 1 bonus
        if st.spec is None:  # a proposal never seen (late reply): only a target-only round fits it
            return 0 if k == 0 else None
        if not 0 <= k <= len(st.spec) or list(req.output_ids[len(req.output_ids) - 1 - k : -1]) != st.spec[:k]:
            return None
        return k

    def _release_departed(self, live: set) -> None:
        gone = [rid for rid in self.states if rid not in live]
        if gone:
            self._inflight = ("release", gone, None, 0)
            self.client.release(gone, timeout_s=self.cfg.round_deadline_s)
            for rid in gone:
                del self.states[rid]
            self.features.drop(gone)
            self._inflight = None

    def prefill_early(self, reqs, temperatures: list[float]) -> int:
        """While the target prefills: send the draft these requests' prompts (early_prefill.py)."""
        return early_prefill.start(self, reqs, temperatures, PREFILL_S_PER_TOKEN)

    def settle_early(self) -> None:
        """After the target's prefill: take the draft's Ack if it is already in (never waits)."""
        if self._late is not None and self._late.kind == early_prefill.KIND and self.client_ok:
            try:
                self._settle_late(0.0)
            except Exception as exc:
                self._fail(exc)

    def release(self, rids: list[str]) -> None:
        """Finished requests.  With the link down or a late reply outstanding their entries stay, and
        a later round releases them (``_release_departed``)."""
        self.features.drop(rids)
        rids = [r for r in rids if r in self.states]
        if not rids or not self.client_ok:
            return
        try:
            # the last round's ahead Speculate is due in a few ms: take it (a finished request's last round
            # sends one, and an idle server has no next round to release the request at)
            if self._late is not None and self._late.kind == ahead.KIND and not ahead.settle(self, self._deadline()):
                return
            late = self._late
            early = late is not None and late.kind == early_prefill.KIND  # an Ack due at once: take it
            if not self._settle_late((late.first_wait or self._deadline()) if early else 0.0):
                return
            self._inflight = ("release", rids, None, 0)
            self.client.release(rids, timeout_s=self.cfg.round_deadline_s)
            for rid in rids:
                del self.states[rid]
            self._inflight = None
        except TimeoutError as exc:
            self._missed(exc)
        except Exception as exc:
            self._fail(exc)

    def _fallback(self, bs: int, t0: float) -> Proposal:
        self.stats.fallback_rows += bs
        return Proposal(
            tokens=torch.zeros(bs, self.k, dtype=torch.int64), q16=None,
            q_valid=torch.zeros(bs, dtype=torch.bool), max_accept=torch.zeros(bs, dtype=torch.int64),
            hit=torch.zeros(bs, dtype=torch.bool), wait_s=time.perf_counter() - t0)

    def record(self, accept_lens: list[int], verify_s: float = 0.0, accept_s: float = 0.0,
               t_start: Optional[float] = None, t_end: Optional[float] = None,
               hits: Optional[list[bool]] = None) -> None:
        """One verified round: accepted lengths, hit rows and where its time went (perf_counter stamps)."""
        self.stats.record(accept_lens, self.k, verify_s, accept_s, t_start, t_end, hits)

    def as_dict(self) -> dict:
        return self.stats.as_dict(self.cfg.mode, self.k, self.cfg.fan_out)

    def write_stats(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.as_dict(), fh)
        os.replace(tmp, path)

    def summary(self) -> str:
        return self.stats.summary(self.cfg.mode)
