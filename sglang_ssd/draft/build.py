"""The SSD cache build (async mode, after a reply): glue, forks, K tree depths, store.

With a width w < K (Speculate.width: the worker verifies only w drafts per request at this batch size)
the speculations are w tokens long, the forks cover outcomes j = 0 .. w ("all w accepted" keeps the
draft's own next token among its guesses) and the tree stops at depth w: entries are w-token speculations.

The build never makes the target wait for it: between tree depths (and between chunks of a long depth,
and after the glue) it asks ``should_stop`` -- the server's "is a message waiting?" -- and, when one is,
stops at once so the next Speculate is answered without delay.  A request whose tree finished d of K
depths (1 <= d < K) keeps d-token entries: the token rows are padded with PAD (-1) from position d on,
their q rows with zeros there; a hit on one is served as a d-token speculation (the verifier's
max_accept becomes d).  A request with no finished depth stores nothing: its next round is a miss and
takes the backup.  Either way every stored token is the one sampled from its stored q, so greedy and
sampled verification stay exact.

Knobs (constructor arguments of DraftEngine, defaults from the environment of the draft process):
  SGLANG_SSD_BUILD_CHUNK_TOKENS  branch tokens per tree forward before the next poll (0 = one forward
                                 per depth; default 64 on CPU, 0 on CUDA where a forward costs the same
                                 for few or many tokens)
  SGLANG_SSD_MAX_BUILD_DEPTH     build at most this many depths (tests: forces short entries / no entries)
  SGLANG_SSD_BUILD_BUDGET        0 = always build the full fan-outs; default 1: scale them down while builds
                                 are cut (budget.py)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch

from sglang_ssd.config import env_number
from sglang_ssd.draft.runner import ForwardItem
from sglang_ssd.draft.sampling import sample_rows
from sglang_ssd.draft.tree import fork_indices, tree_kv_len, tree_mask, tree_positions, tree_slots

if TYPE_CHECKING:
    from sglang_ssd.draft.engine import DraftEngine

logger = logging.getLogger(__name__)

PAD = -1  # token value of positions a cut build did not reach (protocol.SpecReply)
CHUNK_ENV, DEPTH_ENV = "SGLANG_SSD_BUILD_CHUNK_TOKENS", "SGLANG_SSD_MAX_BUILD_DEPTH"
CPU_CHUNK_TOKENS = 64


def default_chunk_tokens(device: torch.device) -> int:
    env = env_number(CHUNK_ENV, None)
    if env is not None:
        return env
    return 0 if device.type == "cuda" else CPU_CHUNK_TOKENS


def default_max_depth() -> Optional[int]:
    return env_number(DEPTH_ENV, None)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _chunks(sizes: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive plan indices grouped so a group has <= max_tokens branches (>= 1 plan; 0 = one group)."""
    if max_tokens <= 0:
        return [list(range(len(sizes)))] if sizes else []
    out, cur, tot = [], [], 0
    for i, n in enumerate(sizes):
        if cur and tot + n > max_tokens:
            out.append(cur)
            cur, tot = [], 0
        cur.append(i)
        tot += n
    if cur:
        out.append(cur)
    return out


def build_cache(e: "DraftEngine", should_stop: Optional[Callable[[], bool]] = None) -> None:
    """Pre-compute the next round for e.pending's likely outcomes; stops early when should_stop()."""
    pending, e.pending = e.pending, []
    if not pending or e.session is None:
        return
    stop = should_stop or (lambda: False)
    s = e.session
    k_spec = s.k  # the KV / tree layout keeps K slots per branch; the worker verifies `width` of them
    width = e.round_width
    limit = width if e.max_build_depth is None else min(width, e.max_build_depth)
    t0 = time.perf_counter()
    for st, _ in pending:
        st.cache_fan = None  # set again below for the requests whose entries get stored
    if stop():  # the next message is already here: answer it, build nothing
        _record(e, t0, 0.0, 0.0, cut_depth=0, before_glue=True, stopped=True)
        return
    # (a) GLUE: KV + logits for [root, s_1..s_d] at slots/positions P..P+d (d = len(last_spec) <= K)
    items, reuse = [], []
    for st, jit in pending:
        p, d = st.root_slot, len(st.last_spec)
        seq = st.tokens + st.last_spec
        valid = st.valid_prefix(seq)
        if jit is not None and d and len(jit) == d and valid >= p + d:  # backup decode ran root..s_{d-1}
            start, n_logits = p + d, 1
        else:
            jit, start, n_logits = None, min(valid, p), d + 1
        st.begin_write(start)
        items.append(ForwardItem.extend(st.kv, seq[start:], start, n_logits))
        reuse.append(jit)
    outs = e.runner.forward(items, cols=True)
    glue = []
    for (st, _), it, jit, out in zip(pending, items, reuse, outs):
        st.end_write(it.tokens.tolist())
        glue.append(out if jit is None else torch.cat([jit, out]))  # [d+1, W] over the runner's columns
    t_glue = _ms(t0)
    if limit == 0 or stop():
        _record(e, t0, t_glue, 0.0, cut_depth=0, stopped=limit > 0)
        return

    # (b) FORKS: top-fan[j] raw-logit tokens at glue row j, s_{j+1} excluded for j < d.  After a short
    # speculation (d < K) the outcomes are j = 0..d (j = d: "all d accepted"): engine.fan_plan.
    plans = []
    for (st, _), z in zip(pending, glue):
        d = len(st.last_spec)
        fan = e.fan_plan(d, st.last_hit)  # F_0..F_d for this verify's d + 1 outcomes
        fan = e.budget.fan(fan)  # scaled down while full builds do not fit the verify window (budget.py)
        fan = [min(f, e.runner.n_cols - (1 if j < d else 0)) for j, f in enumerate(fan)]
        if sum(fan) == 0:
            continue
        z = z.clone()
        if d:  # s_{j+1} (a column unless a fast backup copied a token the head does not cover)
            c = e.runner.to_cols(torch.as_tensor(st.last_spec, device=z.device))
            z[torch.arange(d, device=z.device)[c >= 0], c[c >= 0]] = -torch.inf
        top = e.runner.to_tokens(torch.topk(z, max(fan), dim=-1).indices).cpu()  # [d+1, maxF] token ids
        if e.lookup.setting is not None and st.temperature <= 0:  # the bonus-guess copy is the greedy rule's
            _lookup_guesses(e, st, top, fan, d)
        guesses = torch.cat([top[j, :f] for j, f in enumerate(fan)])   # fork-index-major
        plans.append((st, fork_indices(fan), guesses, fan))

    # (c) TREE: up to K depths, batched over all branches of all requests (chunked), polling between
    t1 = time.perf_counter()
    results = _decode_tree(e, plans, k_spec, width, limit, stop)

    # (d) STORE: cache[(rid, j, guess)] = (tokens, q16), PAD from the first depth not reached
    for (st, forks, guesses, fan), (toks, q16, done) in zip(plans, results):
        if done == 0:
            continue
        e.cache.put(st.rid, list(zip(forks, guesses.tolist())), toks, q16, st.temperature)
        st.cache_fan = fan
    t_tree = _ms(t1)
    reached = min((done for _, _, done in results), default=k_spec)
    full = min(width, k_spec)  # a build to the verify's width is complete (max_build_depth below it is a cut)
    _record(e, t0, t_glue, t_tree, cut_depth=reached if reached < full else None, stopped=reached < limit)


def _decode_tree(e: "DraftEngine", plans, k_spec: int, width: int, limit: int, stop: Callable[[], bool]):
    """-> per plan (tokens [B, K] long, PAD-padded; q16 [B, K, W] over the runner's columns or None;
    depths done)."""
    if not plans:
        return []
    v = e.runner.n_cols
    inputs = [g for _, _, g, _ in plans]
    sizes = [len(g) for g in inputs]
    toks = [torch.full((n, k_spec), PAD, dtype=torch.long) for n in sizes]
    q16s = [torch.zeros(len(g), k_spec, v, dtype=torch.float16, device=e.runner.device)
            if st.temperature > 0 else None for (st, _, g, _) in plans]
    done = [0] * len(plans)
    fan = e.fan_plan(width, True)  # a cached speculation is a hit next round: its cache uses this plan
    chunks = _chunks(sizes, e.build_chunk_tokens)
    for d in range(limit):
        for c, chunk in enumerate(chunks):
            items = []
            for r in chunk:
                st, forks, _, _ = plans[r]
                p, b = st.root_slot, len(forks)
                items.append(ForwardItem(st.kv, inputs[r], tree_positions(p, forks, d),
                                         tree_slots(p, k_spec, b, d), tree_kv_len(p, k_spec, b, d),
                                         tree_mask(p, k_spec, forks, d), b))
            logits = torch.cat(e.runner.forward(items, cols=True))
            temps = torch.cat([torch.full((sizes[r],), plans[r][0].temperature) for r in chunk])
            cs = torch.cat([torch.full((sizes[r],), plans[r][0].saguaro_c) for r in chunk])
            reads = e.lookup.reads([plans[r][0] for r in chunk])
            rows_st, extras = _branch_contexts(plans, chunk, toks, d) if reads else (None, None)
            mix = e.lookup.mix_cols(rows_st, extras, e.runner.to_cols) if rows_st is not None else None
            tok, q = sample_rows(logits, temps, e.gen, torch.full((len(temps),), fan[d]), cs, mix=mix)
            tok = e.runner.to_tokens(tok)
            if rows_st is not None:
                tok = e.lookup.apply(rows_st, extras, logits, tok)
            csizes = [sizes[r] for r in chunk]
            outs = torch.split(tok.cpu(), csizes)
            qs = torch.split(q, csizes) if q is not None else [None] * len(chunk)
            for r, x, qr in zip(chunk, outs, qs):
                inputs[r] = x
                toks[r][:, d] = x
                if q16s[r] is not None:
                    q16s[r][:, d] = qr
                done[r] = d + 1
            more = d + 1 < limit or c + 1 < len(chunks)
            if more and stop():
                return list(zip(toks, q16s, done))
    return list(zip(toks, q16s, done))


def _lookup_guesses(e: "DraftEngine", st, top: torch.Tensor, fan: list[int], d: int) -> None:
    """Greedy rows: the n-gram copy after outcome j (s_1..s_j accepted) replaces the last of its F_j >= 2
    guesses when the draft's guesses miss it (and it is not the rejected s_{j+1}): after a rejection the
    bonus is the target's argmax, which the copy predicts where the draft did not (lookup.py).  The draft's
    first guess always stays."""
    spec = st.last_spec or []
    for j, f in enumerate(fan):
        if f < 2:
            continue
        g = e.lookup.guess(st, spec[:j])
        if g is None or g in top[j, :f].tolist() or (j < d and g == spec[j]):
            continue
        top[j, f - 1] = g
        e.lookup.guesses += 1


def _branch_contexts(plans, chunk: list[int], toks: list[torch.Tensor], d: int):
    """Per branch row of the chunk: its request's state and the speculative tokens between the committed
    context and depth d's token (s_1..s_j of the last speculation, the fork's guess, depths 0..d-1)."""
    rows_st, extras = [], []
    for r in chunk:
        st, forks, guesses, _ = plans[r]
        rows_st += [st] * len(forks)
        spec, prev = st.last_spec or [], toks[r][:, :d].tolist()
        extras += [spec[:j] + [g] + p for j, g, p in zip(forks, guesses.tolist(), prev)]
    return rows_st, extras


def _record(e: "DraftEngine", t0: float, t_glue: float, t_tree: float, cut_depth: Optional[int],
            before_glue: bool = False, stopped: bool = False) -> None:
    """Build stats; cut_depth = depths every request finished when the build was cut (None: not cut);
    stopped = cut because the next message came (not by max_build_depth): the budget shrinks."""
    total = _ms(t0)
    e.budget.built(stopped, total / 1e3)
    st = e.stats
    st.builds += 1
    st.build_ms += total
    st.glue_ms += t_glue
    st.tree_ms += t_tree
    st.last = {"build_ms": total, "glue_ms": t_glue, "tree_ms": t_tree}
    u = st.unsent
    u.update(builds=u.get("builds", 0) + 1, build_ms=u.get("build_ms", 0.0) + total,
             glue_ms=u.get("glue_ms", 0.0) + t_glue, tree_ms=u.get("tree_ms", 0.0) + t_tree,
             cut_depth=-1 if cut_depth is None else cut_depth)
    if cut_depth is not None:
        st.builds_cut += 1
        st.builds_cut_before_glue += int(before_glue)
        st.cut_depth_hist[cut_depth] = st.cut_depth_hist.get(cut_depth, 0) + 1
        logger.debug("cache build cut after %d depth(s) (%.1f ms)", cut_depth, total)
    e.backups.built(total / 1e3)
