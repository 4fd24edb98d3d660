"""What DraftLink keeps between rounds: the proposal handed to the verifier, what the draft holds per
request (as far as the worker knows), a request whose reply missed its deadline, the counters (with
their per-round bookkeeping and the stats file's form) and the check of a reply's token rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

UNKNOWN = -1  # _ReqState.known_len of a request whose draft-side state is unknown: re-prefill it


@dataclass
class Proposal:
    """K draft tokens per request and what verification needs to stay exact."""

    tokens: torch.Tensor  # [bs, K] int64
    q16: Optional[torch.Tensor]  # [bs, K, V] float16 proposal distributions on the verifier's device, rows with q only
    q_valid: torch.Tensor  # [bs] bool: row has a sampled (non-deterministic) proposal
    max_accept: torch.Tensor  # [bs] int64: drafts that may be accepted (0 = target-only round)
    hit: torch.Tensor  # [bs] bool: came from the speculation cache
    wait_s: float = 0.0
    # [bs, K] float32 on the verifier's device: each q16 row's exact float64 sum (dequantize_proposal's
    # normaliser), taken from the sparse wire rows; 1 on rows without q.  None: not computed
    q_sums: Optional[torch.Tensor] = None

    def first(self, k: int) -> "Proposal":
        """The first k drafts of each chain (k <= K): still exact, each d_j was drawn from q_j given
        d_1..d_(j-1), so verifying a prefix of the chain against its own q is the same rule on fewer rows."""
        if k >= self.tokens.shape[1]:
            return self
        cut = lambda t: None if t is None else t[:, :k]
        return Proposal(self.tokens[:, :k], cut(self.q16), self.q_valid, self.max_accept.clamp(max=k), self.hit,
                        self.wait_s, cut(self.q_sums))


def reply_q16(q: np.ndarray, q_ids: np.ndarray, q_rows: torch.Tensor, bs: int, k: int, vocab_size: int,
              device) -> torch.Tensor:
    """A SpecReply's q rows -> float16 [bs, K, V] on the verifier's device, zeros on rows without q.

    The wire values move first, as they came (float16 [m, K, W] over the head's ids q_ids, or dense
    [m, K, V] when q_ids is empty), and are scattered there: no dense [bs, K, V] array is built on the
    host or copied to the device, and both ends dequantise the same float16 bytes
    (proposal.dequantize_proposal, exact whatever the layout)."""
    m = int(q_rows.numel())
    width = len(q_ids) if len(q_ids) else vocab_size
    if tuple(q.shape) != (m, k, width):
        raise ValueError(f"draft sent q of shape {tuple(q.shape)}, expected {(m, k, width)}")
    if len(q_ids) and int(q_ids[-1]) >= vocab_size:
        raise ValueError(f"draft sent q over token id {int(q_ids[-1])} >= vocab size {vocab_size}")
    rows = torch.from_numpy(np.ascontiguousarray(q)).to(device, non_blocking=True)
    out = torch.zeros(bs, k, vocab_size, dtype=torch.float16, device=device)
    r = q_rows.to(device)[:, None, None]
    j = torch.arange(k, device=device)[None, :, None]
    ids = (torch.from_numpy(np.ascontiguousarray(q_ids)).to(device, non_blocking=True) if len(q_ids)
           else torch.arange(vocab_size, device=device))[None, None, :]
    return out.index_put_((r, j, ids), rows)  # one scatter: out[q_rows[a], t, ids[c]] = q[a, t, c]


def reply_q_sums(q: np.ndarray, q_rows: torch.Tensor, bs: int, k: int, device) -> torch.Tensor:
    """[bs, K] float32: the exact float64 sum of each wire q row (zeros elsewhere add nothing, so it is
    the dense row's sum bit for bit), 1 on rows without q."""
    sums = torch.ones(bs, k, dtype=torch.float32)
    if q_rows.numel():
        sums[q_rows] = torch.from_numpy(np.ascontiguousarray(q).sum(axis=-1, dtype=np.float64)).to(torch.float32)
    return sums.to(device)


def assemble_proposal(bs: int, k: int, vocab_size: int, device, pieces) -> Proposal:
    """One round's Proposal from one or two SpecReplies (the ahead reply and the ordinary one for the rest
    of the batch).  pieces: (reply, batch position of each reply row or -1 = not this batch's, usable
    tokens [m, K], max_accept [m]).  q rows keep their wire bytes; rows of different replies never overlap,
    so their scattered q16 add up exactly (x + 0)."""
    tokens = torch.zeros(bs, k, dtype=torch.int64)
    max_accept = torch.zeros(bs, dtype=torch.int64)
    hit = torch.zeros(bs, dtype=torch.bool)
    q_valid = torch.zeros(bs, dtype=torch.bool)
    q_sums = torch.ones(bs, k, dtype=torch.float32)
    q16 = None
    for reply, pos, toks, ma in pieces:
        pos_t = torch.as_tensor(pos, dtype=torch.int64)
        used = pos_t >= 0
        at = pos_t[used]
        tokens[at], max_accept[at] = toks[used], ma[used]
        hit[at] = torch.as_tensor(np.asarray(reply.hit), dtype=torch.bool).reshape(-1)[used]
        q_rows = torch.as_tensor(np.asarray(reply.q_rows), dtype=torch.int64)
        if not q_rows.numel():
            continue
        keep = used[q_rows]
        if not bool(keep.any()):
            continue
        q = reply.q if bool(keep.all()) else reply.q[keep.numpy()]
        rows_b = pos_t[q_rows[keep]]
        part = reply_q16(q, reply.q_ids, rows_b, bs, k, vocab_size, device)
        q16 = part if q16 is None else q16 + part
        q_valid[rows_b] = True
        q_sums[rows_b] = reply_q_sums(q, rows_b, bs, k, "cpu")[rows_b]
    return Proposal(tokens, q16, q_valid, max_accept, hit, 0.0, None if q16 is None else q_sums.to(device))


@dataclass
class _ReqState:
    """The draft's state of one request: it proposed ``spec`` when it knew ``known_len`` tokens.
    spec None: a proposal the worker never saw (its reply was late) -- only k = 0 is a consistent
    outcome for it.  known_len UNKNOWN: the draft's state is not known (re-prefill before use); the
    entry stays so that a request that finishes meanwhile is still released."""

    spec: Optional[list[int]]
    known_len: int


@dataclass
class _Late:
    """A request whose reply missed its deadline.  The draft (alive, just slow) still processes it, in
    order, before anything sent after it; nothing more is sent until its reply is in."""

    req_id: int
    kind: str  # "prefill" | "speculate" | "release" | "prefill0" (early_prefill.py: not late, just sent early)
    rids: list[str]
    round_id: int
    since: float  # time.monotonic() when it missed its deadline (prefill0: when it was sent)
    waited: bool = False  # the one bounded wait for it (the next round) is spent
    knowns: list[int] = field(default_factory=list)  # prefill0: the rows' prompt lengths
    first_wait: Optional[float] = None  # the next round's wait for it (default: the round deadline)


@dataclass
class LinkStats:
    rounds: int = 0
    rows: int = 0
    hits: int = 0
    fallback_rows: int = 0
    accepted: int = 0  # accepted drafts + bonus tokens
    accepted_hit: int = 0  # ... of rows whose speculation came from the cache (E_hit = accepted_hit / hit_rows)
    hit_rows: int = 0  # verified rows that were cache hits (hits counts them as replies come)
    wait_s: float = 0.0
    waited_rounds: int = 0  # rounds whose draft reply took longer than WAITED_S (the target waited)
    verify_s: float = 0.0  # target forward over the chains
    accept_s: float = 0.0  # target probabilities + exact acceptance
    round_s: float = 0.0  # whole decode round inside the worker (wait + verify + accept + glue)
    gap_s: float = 0.0  # scheduler time between consecutive decode rounds (idle gaps > 1 s excluded)
    answer_s: float = 0.0  # the draft's own time to answer (its reply's answer_ms: lookup + backup decode)
    backup_s: float = 0.0  # ... of which just-in-time backup decoding of missed rows
    reconnects: int = 0
    resets: int = 0  # reconnects whose Hello started a fresh draft session (live requests re-prefilled)
    resumes: int = 0  # reconnects whose Hello resumed the same session (state kept)
    errors: int = 0  # broken-link failures (dead process, error reply, bad reply): these reconnect
    early_prefills: int = 0  # rows whose draft prefill was sent while the target prefilled them
    ahead_sent: int = 0  # Speculates sent right after a verify (ahead.py) ...
    ahead_rows_used: int = 0  # ... rows of their replies used by the next round ...
    ahead_rows_dropped: int = 0  # ... rows SGLang committed differently (re-prefilled)
    deadline_misses: int = 0  # requests whose reply did not arrive within its deadline (no reconnect)
    late_replies_discarded: int = 0  # replies that arrived after their deadline, received and dropped
    stalled_rounds: int = 0  # rounds decoded target-only without asking, a late reply still outstanding
    backup_rows: int = 0  # rows of used replies the draft's backup answered (cache misses) ...
    fast_rows: int = 0  # ... of which by the fast (n-gram / random) backup
    builds: int = 0  # draft cache builds reported by replies (used or late), their total time, and the
    build_ms: float = 0.0  # cut ones by the depths they had finished
    cuts: dict = field(default_factory=dict)
    hist: list[int] = field(default_factory=list)
    last_round_end: Optional[float] = None  # perf_counter stamp of the previous round's end

    def replied(self, reply, used: bool) -> None:
        """A SpecReply came: its builds always count; its rows only when the proposal was used."""
        self.builds += reply.builds
        self.build_ms += reply.build_ms
        if reply.builds and reply.cut_depth >= 0:
            self.cuts[reply.cut_depth] = self.cuts.get(reply.cut_depth, 0) + 1
        if used:
            self.backup_rows += int((~reply.hit).sum())
            self.fast_rows += reply.fast_rows

    def record(self, accept_lens: list[int], k: int, verify_s: float = 0.0, accept_s: float = 0.0,
               t_start: Optional[float] = None, t_end: Optional[float] = None,
               hits: Optional[list[bool]] = None) -> None:
        """One verified round: accepted lengths, which rows were cache hits, and where its time went
        (perf_counter stamps)."""
        if hits is not None:
            self.hit_rows += sum(hits)
            self.accepted_hit += sum(a for a, h in zip(accept_lens, hits) if h)
        self.verify_s += verify_s
        self.accept_s += accept_s
        if t_start is not None and t_end is not None:
            self.round_s += t_end - t_start
            last = self.last_round_end
            if last is not None and 0 <= t_start - last < 1.0:
                self.gap_s += t_start - last
            self.last_round_end = t_end
        self.rounds += 1
        self.rows += len(accept_lens)
        self.accepted += sum(accept_lens)
        for a in accept_lens:
            self.hist[min(a, k + 1)] += 1

    def as_dict(self, mode: str, k: int, fan_out: list[int]) -> dict:
        rows = max(self.rows, 1)
        return {"mode": mode, "k": k, "fan_out": fan_out, "rounds": self.rounds,
                "rows": self.rows, "hits": self.hits, "hit_rate": self.hits / rows, "accept_len": self.accepted / rows,
                "hit_rows": self.hit_rows, "accepted_hit": self.accepted_hit,
                "accept_len_hit": self.accepted_hit / max(self.hit_rows, 1),
                "accept_len_miss": (self.accepted - self.accepted_hit) / max(self.rows - self.hit_rows, 1),
                "draft_wait_ms": 1000 * self.wait_s / max(self.rounds, 1), "fallback_rows": self.fallback_rows,
                "waited_rounds": self.waited_rounds, "wait_s": self.wait_s, "verify_s": self.verify_s,
                "accept_s": self.accept_s, "round_s": self.round_s, "gap_s": self.gap_s, "answer_s": self.answer_s,
                "backup_s": self.backup_s,
                "errors": self.errors, "reconnects": self.reconnects, "deadline_misses": self.deadline_misses,
                "late_replies_discarded": self.late_replies_discarded, "stalled_rounds": self.stalled_rounds,
                "resets": self.resets, "resumes": self.resumes, "early_prefills": self.early_prefills,
                "ahead_sent": self.ahead_sent, "ahead_rows_used": self.ahead_rows_used,
                "ahead_rows_dropped": self.ahead_rows_dropped,
                "backup_rows": self.backup_rows, "fast_backup_rows": self.fast_rows, "builds": self.builds,
                "builds_cut": sum(self.cuts.values()),
                "accept_hist": self.hist}

    def summary(self, mode: str) -> str:
        rows = max(self.rows, 1)
        return (f"saguaro[{mode}] rounds={self.rounds} accept_len={self.accepted / rows:.2f} "
                f"hit_rate={self.hits / rows:.2f} draft_wait_ms={1000 * self.wait_s / max(self.rounds, 1):.1f} "
                f"fallback_rows={self.fallback_rows} errors={self.errors} deadline_misses={self.deadline_misses} "
                f"resets={self.resets} accept_hist={self.hist}")


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
