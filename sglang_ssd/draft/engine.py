"""DraftEngine: the SSD draft's state machine (no sockets here; server.py feeds it messages).

Speculate = ANSWER FIRST (cache hit, or a just-in-time "backup" decode for missed rows), then -- in
async mode, after the reply has left -- ``build_cache`` (build.py) pre-computes the next round for
every likely outcome: one glue forward over [root, s_1..s_K], top-fan_out bonus guesses per glue index
(the token already proposed there excluded), K batched tree forwards, one entry per (rid, j, guess).
The build stops as soon as the next message is waiting; entries finished to depth d < K are served as
d-token speculations (PAD-padded), so a request's last_spec may be shorter than K.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from sglang_ssd.draft import build
from sglang_ssd.draft.runner import DraftRunner, ForwardItem
from sglang_ssd.draft.backup import SAMPLED_HYBRID_STEPS, BackupChooser, fast_backup, hybrid_steps
from sglang_ssd.draft.lookup import Lookup
from sglang_ssd.draft.budget import BuildBudget
from sglang_ssd.draft.budget import enabled_by_env as budget_enabled_by_env
from sglang_ssd.draft.fanout import LiveFanOut
from sglang_ssd.draft.sampling import sample_rows
from sglang_ssd.draft.spec_cache import SpecCache
from sglang_ssd.draft.state import RequestState
from sglang_ssd.draft.wire_q import wire_q
from sglang_ssd.protocol import (PROTOCOL_VERSION, Ack, Hello, HelloReply, Prefill, Release,
                                 Speculate, SpecReply)
from sglang_ssd.saguaro.datastore import Datastore

logger = logging.getLogger(__name__)

PREFILL_CHUNK = 1024   # tokens per request per prefill forward


class EngineError(Exception):
    """A rejected request (nothing was changed); becomes an ErrorReply."""

    def __init__(self, message: str, rids: Sequence[str] = ()):
        super().__init__(message)
        self.message, self.rids = message, list(rids)


@dataclass
class Session:
    client_id: str
    k: int
    mode: str
    fan_out: list[int]
    fan_out_miss: list[int]
    vocab_size: int
    eos_ids: list[int]
    backup: str = "neural"
    fan_out_auto: bool = False


@dataclass
class Stats:
    rounds: int = 0
    rows: int = 0
    backup_rows: int = 0
    builds: int = 0
    build_ms: float = 0.0
    glue_ms: float = 0.0
    tree_ms: float = 0.0
    answer_ms: float = 0.0
    backup_ms: float = 0.0
    feature_rows: int = 0              # target feature rows received (an EAGLE-3 draft)
    builds_cut: int = 0                # builds stopped early because a message was waiting
    builds_cut_before_glue: int = 0    # ... of which before the glue forward (nothing built)
    cut_depth_hist: dict[int, int] = field(default_factory=dict)  # depths finished by all rows -> cuts
    width_hist: dict[int, int] = field(default_factory=dict)  # Speculate.width (0 = K) -> Speculates
    last: dict[str, float] = field(default_factory=lambda: {"build_ms": 0.0, "glue_ms": 0.0, "tree_ms": 0.0})
    unsent: dict = field(default_factory=dict)  # builds since the last reply (SpecReply builds / *_ms / cut_depth)


@dataclass
class _Prev:  # what the fan-out planner needs of a row's previous round
    last_spec: Optional[list[int]]
    last_hit: bool
    cache_fan: Optional[list[int]]


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class DraftEngine:
    def __init__(self, runner: DraftRunner, seed: int = 0, max_batch: int = 1024,
                 build_chunk_tokens: Optional[int] = None, max_build_depth: Optional[int] = None,
                 build_budget: Optional[bool] = None, corpus: Optional[Datastore] = None):
        self.runner = runner
        # fan-outs scaled so a build fits the verify window (budget.py)
        self.budget = BuildBudget(budget_enabled_by_env() if build_budget is None else build_budget)
        self._t_reply: Optional[float] = None
        self.hybrid_steps = hybrid_steps()  # a hybrid backup's model tokens before its n-gram tail (0: auto)
        # n-gram copies: over an unsure greedy token (the request's own, or the draft's datastore), mixed into a
        # sampled q (lookup.py)
        self.lookup = Lookup(corpus=corpus)
        # a reply's q_ids: the head's ids (sorted, once), empty = q dense over the vocabulary
        self._q_ids = (np.zeros(0, dtype=np.int64) if runner.cols is None
                       else runner.cols.cpu().numpy().astype(np.int64))
        # the cache build polls for the next message between chunks of this many branch tokens
        self.build_chunk_tokens = (build.default_chunk_tokens(runner.device) if build_chunk_tokens is None
                                   else build_chunk_tokens)
        self.max_build_depth = build.default_max_depth() if max_build_depth is None else max_build_depth
        self.max_batch = max_batch
        self.session: Optional[Session] = None
        self.width: Optional[int] = None  # drafts per request the worker verifies (Speculate.width; None = K)
        self.hello_msg: Optional[Hello] = None  # the Hello that started the session, as received
        self.requests: dict[str, RequestState] = {}
        self.cache = SpecCache()
        self.backups = BackupChooser("neural")
        self.fanout: Optional[LiveFanOut] = None
        self.gen = torch.Generator(device=runner.device)
        self.gen.manual_seed(seed)
        self.pending: list[tuple[RequestState, Optional[torch.Tensor]]] = []
        self.stats = Stats()
        self.t_start = time.time()

    # ---------------------------------------------------------------------------------- hello
    def hello(self, msg: Hello) -> HelloReply:
        if msg.version != PROTOCOL_VERSION:
            raise EngineError(f"protocol version {msg.version} != draft's {PROTOCOL_VERSION}")
        if msg.vocab_size != self.runner.vocab_size:
            raise EngineError(f"vocab mismatch: target vocab_size {msg.vocab_size} != draft "
                              f"{self.runner.vocab_size}; the draft must share the target's vocabulary")
        if self.session is not None and self.hello_msg is not None and self.hello_msg.same_session(msg):
            # the same worker reconnected (new socket) with its session's original Hello: keep requests,
            # KV, cache and the fitted fan-outs; it keeps its own per-request state too
            logger.info("session resumed (client %s): keeping %d requests", msg.client_id, len(self.requests))
            return self._hello_reply(resumed=True)
        new = Session(msg.client_id, msg.k, msg.mode, list(msg.fan_out),
                      list(msg.fan_out_miss if msg.fan_out_miss is not None else msg.fan_out),
                      msg.vocab_size, list(msg.eos_ids), msg.backup, msg.fan_out_auto)
        # any other Hello starts a fresh session: the worker then re-prefills its live requests, so
        # anything the draft still holds is stale (and would leak)
        if self.requests:
            logger.warning("new session (client %s, K=%d, %s, fan_out %s): dropping %d requests of the old one",
                           new.client_id, new.k, new.mode, new.fan_out, len(self.requests))
        self.reset()
        self.session, self.hello_msg = new, msg
        self.backups = BackupChooser(new.backup)
        self.fanout = LiveFanOut(sum(new.fan_out), new.k) if new.fan_out_auto and new.mode == "async" else None
        if self.fanout is not None:
            new.fan_out, new.fan_out_miss = map(list, self.fanout.schedules())
        logger.info("session: client %s K=%d mode=%s fan_out=%s fan_out_miss=%s backup=%s", new.client_id,
                    new.k, new.mode, new.fan_out, new.fan_out_miss, new.backup)
        return self._hello_reply(resumed=False)

    def _hello_reply(self, resumed: bool) -> HelloReply:
        return HelloReply(version=PROTOCOL_VERSION, draft_vocab_size=self.runner.vocab_size,
                          draft_model_name=self.runner.cfg.name[:4096], pid=os.getpid(),
                          device=str(self.runner.device), dtype=str(self.runner.dtype).replace("torch.", ""),
                          max_batch=self.max_batch, resumed=resumed, feature_layers=self.runner.feature_layers,
                          feature_dim=self.runner.feature_dim)

    def reset(self) -> None:
        self.requests.clear()
        self.cache.clear()
        self.pending = []
        self.width = None  # a new session's K may be smaller than the old session's width

    def _need_session(self) -> Session:
        if self.session is None:
            raise EngineError("no Hello received yet")
        return self.session

    # -------------------------------------------------------------------------------- prefill
    def prefill(self, msg: Prefill) -> Ack:
        s = self._need_session()
        if len(msg.rids) > self.max_batch:
            raise EngineError(f"batch of {len(msg.rids)} > max_batch {self.max_batch}")
        bad = [r for r, p in zip(msg.rids, msg.prompts) if max(p) >= self.runner.vocab_size]
        if bad:
            raise EngineError("prompt token id >= vocab size", bad)
        budget = s.k + 1 + s.k * max(sum(s.fan_out), sum(s.fan_out_miss))
        states = []
        cs = msg.saguaro_c or [1.0] * len(msg.rids)
        for rid, prompt, temp, c in zip(msg.rids, msg.prompts, msg.temperatures, cs):
            if rid in self.requests:
                logger.info("prefill replaces live request %s", rid)
            self.cache.drop(rid)
            # Saguaro sampling only pays through the cache: sync mode keeps plain sampling (C = 1)
            st = RequestState(rid, list(prompt), self.runner.new_kv(len(prompt) + budget + 1), temp,
                              saguaro_c=c if s.mode == "async" else 1.0)
            self.requests[rid] = st
            states.append(st)
        # all prompt tokens become committed KV (chunked so one forward stays bounded).  An EAGLE-3 head
        # waits for the target's features of the prompt (the first Speculate brings them): its KV is
        # written then, by the first forward that needs it (the glue or the backup catch up)
        prompt_len = 0 if self.runner.eagle else max((len(st.tokens) for st in states), default=0)
        for start in range(0, prompt_len, PREFILL_CHUNK):
            batch = [st for st in states if len(st.tokens) > start]
            items = []
            for st in batch:
                st.begin_write(start)
                items.append(ForwardItem.extend(st.kv, st.tokens[start : start + PREFILL_CHUNK], start))
            self.runner.forward(items, cols=True)
            for st, it in zip(batch, items):
                st.end_write(it.tokens.tolist())
        for st in states:  # an empty proposal: the first round reports k = 0 and the first sampled token
            st.last_spec, st.last_hit = [], False
        replaced = {st.rid for st in states}
        self.pending = [(st, j) for st, j in self.pending if st.rid not in replaced]
        if msg.round0 and s.mode == "async" and not self.runner.eagle:  # the target is prefilling: build round 0
            self.pending += [(st, None) for st in states]
        return Ack(count=len(states))

    def release(self, msg: Release) -> Ack:
        gone = [r for r in msg.rids if self.requests.pop(r, None) is not None]
        for r in msg.rids:
            self.cache.drop(r)
        self.pending = [(st, j) for st, j in self.pending if st.rid in self.requests]
        unknown = sorted(set(msg.rids) - set(gone))
        return Ack(count=len(gone), message=f"unknown rids ignored: {unknown[:16]}" if unknown else "")

    # ------------------------------------------------------------------------------ speculate
    def _check_speculate(self, msg: Speculate) -> Session:
        s = self._need_session()
        if len(msg.rids) > self.max_batch:
            raise EngineError(f"batch of {len(msg.rids)} > max_batch {self.max_batch}")
        unknown = [r for r in msg.rids if r not in self.requests]
        if unknown:
            raise EngineError(f"unknown rid(s) {unknown[:8]}", unknown)
        bad_k = [r for r, k in zip(msg.rids, msg.ks)
                 if k > s.k or (k >= 0 and (self.requests[r].last_spec is None
                                            or k > len(self.requests[r].last_spec)))]
        if bad_k:
            raise EngineError(f"k must be -1 or in [0, K={s.k}], >= 0 only after a speculation and at most "
                              f"its usable length", bad_k)
        bad_b = [r for r, b in zip(msg.rids, msg.bonuses) if b >= self.runner.vocab_size]
        if bad_b:
            raise EngineError("bonus token id >= vocab size", bad_b)
        if len(msg.feat_lens) and msg.features.shape[1] != self.runner.feature_dim:
            raise EngineError(f"features of width {msg.features.shape[1]} for a draft that takes "
                              f"{self.runner.feature_dim} (0: none)", list(msg.rids))
        if len(msg.feat_lens):  # features only for committed positions: the new bonus has none yet
            known = [len(self.requests[r].tokens) + max(k, 0) + 1 for r, k in zip(msg.rids, msg.ks)]
            bad_f = [r for r, a, m, n in zip(msg.rids, msg.feat_starts, msg.feat_lens, known) if m and a + m >= n]
            if bad_f:
                raise EngineError("features for positions past the last committed token", bad_f)
        return s

    def speculate(self, msg: Speculate) -> SpecReply:
        t0 = time.perf_counter()
        s = self._check_speculate(msg)
        if self._t_reply is not None:  # reply -> this request: the window the target's verify gave the build
            self.budget.observe_window(t0 - self._t_reply)
        n, k_spec = len(msg.rids), s.k
        # the worker verifies `width` drafts per request: propose that many, build for that many
        width = self.width = min(msg.width, k_spec) if msg.width > 0 else k_spec
        self.stats.width_hist[msg.width] = self.stats.width_hist.get(msg.width, 0) + 1
        states = [self.requests[r] for r in msg.rids]
        self.backups.observe(states, msg.ks)  # the previous round's speculations were just verified
        prev = [_Prev(st.last_spec, st.last_hit, st.cache_fan) for st in states]  # before advance()
        tokens = torch.full((n, k_spec), build.PAD, dtype=torch.long)
        tokens[:, :width] = 0
        hit = np.zeros(n, dtype=np.bool_)
        q16: list[Optional[torch.Tensor]] = [None] * n
        missed = []
        for i, (st, k, b, t) in enumerate(zip(states, msg.ks, msg.bonuses, msg.temperatures)):
            st.temperature = t
            st.advance(k, b)
            if len(msg.feat_lens) and msg.feat_lens[i]:  # the target's features of committed positions
                start, rows = msg.features_of(i)
                self.runner.put_features(st.kv, start, torch.from_numpy(rows))
                self.stats.feature_rows += rows.shape[0]
                st.invalidate_from(start + 1)  # slots after them were written with the draft's own features
            entry = self.cache.take(st.rid, k, b, t) if s.mode == "async" else None
            if entry is None:
                missed.append(i)
            else:
                hit[i] = True
                row, q = entry.tokens.cpu(), entry.q16
                if width < k_spec:  # an entry built for a wider verify: its first width drafts
                    row = torch.cat([row[:width], torch.full((k_spec - width,), build.PAD, dtype=row.dtype)])
                    q = None if q is None else torch.cat([q[:width], torch.zeros_like(q[width:])])
                tokens[i] = row
                q16[i] = q
        if self.fanout is not None and self.fanout.observe(
                prev, msg.ks, [bool(h) if k >= 0 else None for h, k in zip(hit, msg.ks)]):
            s.fan_out, s.fan_out_miss = map(list, self.fanout.schedules())
        jit_logits: dict[int, torch.Tensor] = {}
        outside: list[tuple[int, int, int]] = []  # fast / hybrid copies of ids outside a reduced head
        t_b = time.perf_counter()
        kind = self.backups.choose(n) if missed else "neural"
        if missed and kind == "fast":
            toks, qs, outside = fast_backup([states[i] for i in missed], width, self.runner.vocab_size, self.gen,
                                            cols=self.runner.cols)
            raw = None
        elif missed and kind == "hybrid":  # one draft-model step, n-gram copy after it
            sub = [states[i] for i in missed]
            steps = self.hybrid_steps or (SAMPLED_HYBRID_STEPS if any(st.temperature > 0 for st in sub) else 1)
            head = self._decode_backup(sub, keep_logits=False, steps=min(steps, width))[:2]
            toks, qs, outside = fast_backup(sub, width, self.runner.vocab_size, self.gen, head=head,
                                            cols=self.runner.cols)
            raw = None
        elif missed:
            toks, qs, raw = self._decode_backup([states[i] for i in missed], keep_logits=s.mode == "async",
                                                steps=width)
        if missed:
            for r, i in enumerate(missed):
                tokens[i, :width] = toks[r]
                q = None if qs is None or msg.temperatures[i] <= 0 else qs[r]
                if q is not None and width < k_spec:  # the wire's q rows are [K, W]: zeros past width
                    q = torch.cat([q, q.new_zeros(k_spec - width, q.shape[1])])
                q16[i] = q
                if raw is not None:
                    jit_logits[i] = raw[r]
        backup_ms = _ms(t_b) if missed else 0.0
        self.backups.replied(kind, len(missed), backup_ms / 1e3 if missed else None)
        for i, st in enumerate(states):  # a short (cut-build) entry's PAD tail was never proposed
            row = tokens[i].tolist()
            st.last_spec, st.last_hit = row[:row.index(build.PAD)] if build.PAD in row else row, bool(hit[i])
        if s.mode == "async":
            self.pending = [(st, jit_logits.get(i)) for i, st in enumerate(states)]
        q_rows = [i for i in range(n) if msg.temperatures[i] > 0]
        at = {i: r for r, i in enumerate(q_rows)}  # a copy outside the head: (reply q row, depth, token)
        outside = [(at[missed[r]], d, t) for r, d, t in outside]
        q, q_ids = wire_q([q16[i] for i in q_rows], k_spec, self.runner.cols, self.runner.vocab_size, self._q_ids,
                          outside)
        st_ = self.stats
        st_.rounds += 1
        st_.rows += n
        st_.backup_rows += len(missed)
        st_.backup_ms += backup_ms
        answer_ms = _ms(t0)
        st_.answer_ms += answer_ms
        self._t_reply = time.perf_counter()
        built, st_.unsent = st_.unsent, {}
        return SpecReply(round_id=msg.round_id, tokens=tokens.numpy(), hit=hit,
                         q_rows=np.asarray(q_rows, dtype=np.int64), q=q, q_ids=q_ids, answer_ms=answer_ms,
                         backup_ms=backup_ms, fast_rows=len(missed) if kind != "neural" else 0, **built)

    @property
    def round_width(self) -> int:
        """Drafts per request the worker verifies this round (the last Speculate's width, else K)."""
        k = self.session.k
        return k if self.width is None else min(self.width, k)

    def fan_plan(self, d: int, from_cache: bool) -> list[int]:
        """F_0..F_d: the guesses to cache at each outcome j = 0..d of a verify of d drafts, for a row whose
        speculation came from the cache (from_cache) or the backup.  With the fitted fan-out a verify of
        d < K drafts (batch-size-aware k, a short entry) gets its own Theorem-12 plan over its d + 1
        outcomes with the whole budget; otherwise the session's schedule, outcome d ("all d accepted")
        taking the largest of F_d..F_K."""
        s = self.session
        if self.fanout is not None and self.fanout.by_width and 0 < d < s.k:
            return list(self.fanout.schedule_for(from_cache, d))
        fan = s.fan_out if from_cache else s.fan_out_miss
        return list(fan[:d]) + [max(fan[d:])]

    def _decode_backup(self, states: Sequence[RequestState], keep_logits: bool = True, steps: Optional[int] = None):
        """Just-in-time K-token decode (or the first `steps` tokens: the round's width) from each state's
        context, batched across rows.

        -> tokens [m, K], q16 [m, K, W] or None, raw logits [m, K, W] (reused as glue rows 0..K-1;
        None unless keep_logits); W = the runner's column space (a reduced head's own ids, or V)."""
        k_spec = self.session.k if steps is None else steps
        m, v = len(states), self.runner.n_cols
        temps = [st.temperature for st in states]
        cs = [st.saguaro_c for st in states]
        # a backup-drafted speculation is cached next round with the backup's plan for this round's width:
        # s_{t+1} is down-weighted on the top-F tokens that will be guessed as bonus if it is rejected
        # (F = fan_plan(width, False)[t])
        fan_miss = self.fan_plan(self.round_width, False)
        toks = torch.zeros(m, k_spec, dtype=torch.long)
        raw = torch.zeros(m, k_spec, v, dtype=torch.float32, device=self.runner.device) if keep_logits else None
        q16 = None
        items = []
        for st in states:  # step 0 catches up: every context token without valid KV, root included
            start = min(st.kv_valid, st.root_slot)
            st.begin_write(start)
            items.append(ForwardItem.extend(st.kv, st.tokens[start:], start))
        for t in range(k_spec):
            logits = torch.cat(self.runner.forward(items, cols=True))
            for st, it in zip(states, items):
                st.end_write(it.tokens.tolist())
            reads = self.lookup.reads(states)
            extras = ([row[:t] for row in toks.tolist()] if t else [[]] * m) if reads else None  # round so far
            mix = self.lookup.mix_cols(states, extras, self.runner.to_cols) if reads else None
            tok, q = sample_rows(logits, temps, self.gen, [fan_miss[t]] * m, cs, mix=mix)
            tok = self.runner.to_tokens(tok)
            if reads:
                tok = self.lookup.apply(states, extras, logits, tok)
            toks[:, t] = tok.cpu()
            if raw is not None:
                raw[:, t] = logits
            if q is not None:
                if q16 is None:
                    q16 = torch.zeros(m, k_spec, v, dtype=torch.float16, device=q.device)
                q16[:, t] = q
            if t + 1 < k_spec:  # feed s_{t+1} at slot root + t + 1
                items = []
                for st, x in zip(states, tok.tolist()):
                    slot = st.root_slot + t + 1
                    st.begin_write(slot)
                    items.append(ForwardItem.extend(st.kv, [x], slot))
        return toks, q16, raw

    # ---------------------------------------------------------------------------- cache build
    def build_cache(self, should_stop: Optional[Callable[[], bool]] = None) -> None:
        """Async mode, after the reply: pre-compute the next round for the likely outcomes, stopping
        early (short or no entries) as soon as should_stop() says a message is waiting (build.py)."""
        build.build_cache(self, should_stop)

    # ---------------------------------------------------------------------------------- stats
    def health(self) -> dict[str, float]:
        st, c = self.stats, self.cache.total
        builds = max(st.builds, 1)
        return {
            "pid": os.getpid(), "uptime_s": time.time() - self.t_start,
            "rounds": st.rounds, "rows": st.rows, "hits": c.hits, "misses": c.misses,
            "forced_misses": c.forced_misses, "hit_rate": c.hits / max(c.lookups, 1),
            "backup_rows": st.backup_rows, "live_requests": len(self.requests), "feature_rows": st.feature_rows,
            "neural_backup_rows": self.backups.rows["neural"], "fast_backup_rows": self.backups.rows["fast"],
            "hybrid_backup_rows": self.backups.rows["hybrid"],
            "backup_fast_now": int(self.backups.policy.current == "fast"),
            **(self.fanout.report() if self.fanout is not None else {}),
            "kv_tokens": sum(r.kv_valid for r in self.requests.values()),
            "kv_bytes": sum(r.kv.nbytes() for r in self.requests.values()),
            "cache_entries": self.cache.num_entries(), "cache_bytes": self.cache.nbytes(),
            "builds": st.builds, "avg_build_ms": st.build_ms / builds, "avg_glue_ms": st.glue_ms / builds,
            "avg_tree_ms": st.tree_ms / builds, "last_build_ms": st.last["build_ms"],
            "builds_cut": st.builds_cut, "builds_cut_before_glue": st.builds_cut_before_glue,
            **{f"cut_depth_{d}": n for d, n in sorted(st.cut_depth_hist.items())},
            **{f"width_{w}": n for w, n in sorted(st.width_hist.items())},
            **self.budget.report(),
            "lookup_rows": self.lookup.rows, "lookup_copies": self.lookup.copies,
            "lookup_guesses": self.lookup.guesses, "lookup_mixed": self.lookup.mixed,
            "lookup_corpus": self.lookup.corpus_copies,
            "avg_answer_ms": st.answer_ms / max(st.rounds, 1),
            "avg_backup_ms": st.backup_ms / max(st.rounds, 1),
            "forward_calls": self.runner.forward_calls, "forward_tokens": self.runner.forward_tokens,
            "k": self.session.k if self.session else 0,
            "async": int(bool(self.session and self.session.mode == "async")),
        }
