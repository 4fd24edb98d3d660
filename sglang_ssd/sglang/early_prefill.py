"""Draft prefill off the critical path (issue 14 item 5).

The worker sends the draft its new requests' prompts BEFORE the target's own prefill forward runs
(``start``), so the draft encodes them on its core while the target encodes them on its own, and,
in async mode, goes on to build a round-0 speculation cache keyed by its top guesses of the first
sampled token (``Prefill.round0``).  A prefilled request counts as having proposed an empty
speculation at the prompt's length: the first decode round reports k = 0 with the sampled token as
the bonus, which hits the round-0 cache when the guess was right.

The Prefill travels as an outstanding call of the link (``_Late`` of kind "prefill0"): nothing else is
sent until its Ack is in, the first decode round waits for it at most once (bounded as a prefill is),
and if it fails or never comes the rows are simply prefilled the old way at a later round.
SGLang tells a speculative worker only of requests that finish in decode rounds: a request that ends
with its prefill (``finished_at_prefill``) is released at once; one aborted right after its prefill is
released at the next decode round (``DraftLink._release_departed``).
"""

from __future__ import annotations

import logging
import time

from sglang_ssd.protocol import Ack, Prefill
from sglang_ssd.sglang import ahead
from sglang_ssd.sglang.link_state import UNKNOWN, _Late, _ReqState

logger = logging.getLogger(__name__)

KIND = "prefill0"
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


def prefill_complete(req) -> bool:
    """This prefill batch finishes the request's prompt (not a middle chunk of a chunked prefill)."""
    end = getattr(req, "extend_end", None)
    return end is None or end >= len(req.origin_input_ids) + len(req.output_ids)


def start(link, reqs, temperatures, s_per_token: float) -> int:
    """Send a round-0 Prefill for the requests this prefill batch completes; -> rows sent."""
    if link._late is not None and link._late.kind == ahead.KIND and link.client_ok:
        try:  # the last decode round's ahead Speculate: its reply first (kept for the next decode round)
            ahead.settle(link, link._deadline())
        except Exception as exc:
            link._fail(exc)
            return 0
    if link.client is None or not link.client_ok or link._late is not None or link._inflight is not None:
        return 0
    rows = []
    for r, t in zip(reqs, temperatures):
        full = len(r.origin_input_ids) + len(r.output_ids)
        st = link.states.get(r.rid)
        sp = getattr(r, "sampling_params", None)
        if getattr(sp, "max_new_tokens", None) == 1:  # finishes with this prefill: nothing to draft
            continue
        if any(getattr(sp, g, None) for g in GRAMMAR_FIELDS):  # refused by saguaro after the prefill
            continue
        if prefill_complete(r) and (st is None or st.known_len != full):
            rows.append((r, float(t), full))
    if not rows:
        return 0
    rids = [r.rid for r, _, _ in rows]
    prompts = [list(r.origin_input_ids) + list(r.output_ids) for r, _, _ in rows]
    msg = Prefill(rids, prompts, [t for _, t, _ in rows], [link._saguaro_c(r) for r, _, _ in rows], round0=True)
    try:
        req_id = link.client.send(msg, timeout_s=0)  # one try: a healthy socket always takes it
    except Exception as exc:  # nothing was sent: the rows are prefilled lazily at their first round
        logger.warning("saguaro: could not send the round-0 prefill (%s); it will be sent with round 1", exc)
        from sglang_ssd.draft.client import DraftUnsent  # (lazily, as draft_link imports the client)

        if isinstance(exc, DraftUnsent):  # no connected draft: the link is broken, reconnect later
            link._fail(exc)
        return 0
    for rid in rids:
        link.states[rid] = _ReqState(None, UNKNOWN)  # until the Ack is in
    late = _Late(req_id, KIND, rids, 0, time.monotonic(), knowns=[full for _, _, full in rows])
    late.first_wait = link.cfg.round_deadline_s + sum(map(len, prompts)) * s_per_token
    link._late = late
    link.stats.early_prefills += len(rids)
    return len(rids)


def settle(link, late: _Late, reply) -> None:
    """The reply to a round-0 Prefill: the rows are known to the draft with an empty proposal."""
    if isinstance(reply, Ack):
        for rid, known in zip(late.rids, late.knowns):
            st = link.states.get(rid)
            if st is not None and st.known_len == UNKNOWN:  # not released or replaced meanwhile
                link.states[rid] = _ReqState([], known)
    else:
        logger.warning("saguaro: the round-0 prefill got a %s: %d rows will be prefilled at their first round",
                       reply.TYPE, len(late.rids))
        link._forget(late.rids)


def finished_at_prefill(reqs, next_token_ids, eos_ids) -> list[str]:
    """Requests this prefill will finish (SGLang tells a spec worker only of requests finishing in
    decode rounds): one new token allowed, or an EOS / stop token sampled.  Their early-prefilled draft
    state is released at once.  (A stop string matched by the first token is released at the next
    decode round, by ``DraftLink._release_departed``.)"""
    out = []
    for r, tok in zip(reqs, next_token_ids):
        sp = getattr(r, "sampling_params", None)
        if sp is None or not prefill_complete(r):
            continue
        stops = set(getattr(sp, "stop_token_ids", None) or ())
        if not getattr(sp, "ignore_eos", False):
            stops |= set(eos_ids) | set(getattr(r, "eos_token_ids", None) or ())
        if getattr(sp, "max_new_tokens", None) == 1 or int(tok) in stops:
            out.append(r.rid)
    return out
