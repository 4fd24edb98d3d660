"""The next round's Speculate sent the moment this round's verify is done (SSD's own timing).

The worker knows a round's outcome (k accepted, bonus) as soon as its acceptance is computed, but the
next round's ``DraftLink.speculate`` runs only after SGLang's work between rounds (output processing,
streaming, scheduling: ~2.5-6 ms per round on a CPU core).  ``send`` tells the draft the outcome at once
and asks for the next speculation, so the draft's answer -- a cache lookup, or on a miss the backup
decode -- and the start of its next cache build overlap that gap instead of the target's wait.

The call is outstanding on the link as a ``_Late`` of kind "ahead" (nothing else is sent before its reply
is in; its rows count as "a proposal not seen yet" at the lengths they will have).  The next round waits
for it at most one round deadline (``settle``); a miss is a deadline miss like any (target-only round,
the reply discarded when it comes, session kept).  ``take`` then uses its rows for the requests whose
committed tokens are exactly what was sent; the rest of the batch (new requests, a row SGLang committed
differently, which is re-prefilled) is asked the ordinary way in the same round.  Off for an EAGLE-3 draft
(its features travel with the Speculate of the round that needs them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from sglang_ssd.protocol import SpecReply, Speculate
from sglang_ssd.sglang.link_state import UNKNOWN, _Late, _ReqState

logger = logging.getLogger(__name__)

KIND = "ahead"


@dataclass
class Ahead:
    rids: list[str]
    knowns: list[int]  # committed length of each row once this round's tokens are in
    tails: list[list[int]]  # this round's committed tokens per row (accepted drafts + bonus)
    round_id: int
    reply: Optional[SpecReply] = None


def send(link, reqs, accept_lens: list[int], out_tokens: list[list[int]], temperatures: list[float],
         width: int = 0) -> bool:
    """After the verify: the round's outcome and the next Speculate, without waiting.  -> sent."""
    if (not link.cfg.send_ahead or link.features.enabled or link.client is None or not link.client_ok
            or link._late is not None or link._inflight is not None or link._ahead is not None):
        return False
    rids, ks, bonuses, knowns, tails = [], [], [], [], []
    for r, a, toks in zip(reqs, accept_lens, out_tokens):
        st = link.states.get(r.rid)
        k = a - 1
        if st is None or st.known_len == UNKNOWN or st.spec is None or not 0 <= k <= len(st.spec) \
                or list(toks[:k]) != st.spec[:k]:
            return False  # a row the draft is not in step with: this round goes the ordinary way
        rids.append(r.rid)
        ks.append(k)
        bonuses.append(int(toks[k]))
        knowns.append(st.known_len + a)
        tails.append([int(x) for x in toks[:a]])
    round_id = link.round_id + 1
    msg = Speculate(round_id, rids, ks, bonuses, [float(t) for t in temperatures], width=int(width))
    try:
        req_id = link.client.send(msg, timeout_s=0)  # one try: a healthy socket always takes it
    except Exception as exc:  # nothing was sent: the next round asks the ordinary way
        from sglang_ssd.draft.client import DraftUnsent

        if isinstance(exc, DraftUnsent):
            link._fail(exc)
        return False
    link.round_id = round_id
    for rid, known in zip(rids, knowns):
        link.states[rid] = _ReqState(None, known)  # proposed at this length, not seen yet
    link._late = _Late(req_id, KIND, rids, round_id, time.monotonic(), knowns=knowns)
    link._ahead = Ahead(rids, knowns, tails, round_id)
    link.stats.ahead_sent += 1
    return True


def received(link, late: _Late, reply) -> None:
    """``_settle_late`` got the reply to an ahead Speculate: keep it for the next round."""
    a = link._ahead
    if a is not None and isinstance(reply, SpecReply) and reply.round_id == late.round_id \
            and reply.tokens.shape[0] == len(late.rids):
        a.reply = reply
        return
    logger.warning("saguaro: the reply to an ahead Speculate was a %s: %d rows will be re-prefilled",
                   reply.TYPE, len(late.rids))
    link._ahead = None
    link._forget(late.rids)


def settle(link, wait_s: float) -> bool:
    """Wait (at most wait_s) for the outstanding ahead reply.  -> False: it missed the deadline, which is
    then an ordinary late Speculate (its reply discarded, its rows at k = 0 next)."""
    if link._settle_late(wait_s):
        return True
    link._late.kind = "speculate"  # the next round gives it the one bounded wait of a late reply
    link._ahead = None
    link.stats.deadline_misses += 1
    logger.warning("saguaro: the draft missed the deadline of an ahead Speculate; this round decodes with the "
                   "target alone, the session is kept and the late reply discarded")
    return False


def take(link, reqs, usable):
    """The received ahead reply against this round's batch -> (reply or None, batch position of each reply
    row or -1, usable tokens [m, K], max_accept [m]).  Rows whose committed tokens are not
    what was sent are marked unknown (re-prefilled by the ordinary path this round); rows no longer in the
    batch keep their state until released."""
    a, link._ahead = link._ahead, None
    if a is None or a.reply is None:
        return None, [], None, None
    tokens, max_accept = usable(a.reply)
    rows, lens = tokens.tolist(), max_accept.tolist()
    batch = {r.rid: i for i, r in enumerate(reqs)}
    pos = []
    for j, rid in enumerate(a.rids):
        i = batch.get(rid)
        spec = rows[j][: lens[j]]
        if i is None:
            link.states[rid] = _ReqState(spec, a.knowns[j])
            pos.append(-1)
            continue
        r, n = reqs[i], len(a.tails[j])
        if len(r.origin_input_ids) + len(r.output_ids) == a.knowns[j] and list(r.output_ids[len(r.output_ids) - n:]) == a.tails[j]:
            link.states[rid] = _ReqState(spec, a.knowns[j])
            pos.append(i)
        else:
            link.states[rid] = _ReqState(None, UNKNOWN)
            link.stats.ahead_rows_dropped += 1
            pos.append(-1)
    return a.reply, pos, tokens, max_accept
