"""Exact chain verification (greedy and speculative sampling) for one round of K drafts.

Row b verifies the chain [root, d_1 .. d_K].  ``p[b, j]`` is the target distribution of the
token after d_j (d_0 = root) and ``q[b, j - 1]`` the distribution the proposer drew d_j from.

Sampled rows use the rule of Leviathan et al. (notes 2.1 / 2.7): accept d_j with probability
min(1, p(d_j) / q(d_j)); at the first rejection draw the bonus from norm(max(0, p - q)).  For any
q this emits exactly p at every position:

    P(out = x) = min(p(x), q(x)) + (1 - sum_y min(p, q)) * max(0, p(x) - q(x)) / sum_y max(0, p - q)
               = min(p, q) + max(0, p - q) = p(x)

because sum_y max(0, p - q) = 1 - sum_y min(p, q).  The identity needs the q in the ratio AND
in the residual to be the one the draft really sampled from -- for Saguaro that is the
down-weighted sigma_{F,C}, not the raw softmax (notes 2.6, 2.7, 5.7); pass the dequantised wire
copy (``proposal.dequantize_proposal``; float16 input is dequantised here).  A deterministic
proposal is q = one-hot(d_j): accept with probability p(d_j), residual = p with d_j zeroed.

Greedy rows accept d_j while it equals argmax p[b, j - 1] (or ``target_argmax``, which the
caller computes from raw logits with ``torch.argmax``), bonus = argmax at the first mismatch.

Outputs follow SGLang: ``accept_lens`` = accepted drafts + 1 (the bonus), and
``out_tokens[b, :accept_lens[b]]`` = accepted drafts then the bonus; the rest is ``PAD_TOKEN``.
"""

from __future__ import annotations

import logging

import torch

from sglang_ssd.saguaro.proposal import dequantize_proposal

logger = logging.getLogger(__name__)

PAD_TOKEN = -1  # value of out_tokens[b, j] for j >= accept_lens[b]


def accept_probability(p_tok: torch.Tensor, q_tok: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) elementwise.

    q(d) == 0 means the proposal could not have produced d; if it did anyway (a caller bug) accept
    iff p(d) > 0 rather than divide by zero.
    """
    ratio = p_tok / q_tok.clamp_min(torch.finfo(q_tok.dtype).tiny)
    return torch.where(q_tok > 0, ratio.clamp(max=1.0), (p_tok > 0).to(p_tok.dtype))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) along the last axis; rows whose residual is all zero fall back to p.

    The fallback only triggers when p <= q everywhere, i.e. p == q: then every draft is accepted
    with probability 1 and the rejection branch has probability zero, so its value is irrelevant
    for exactness -- it only has to be a valid distribution.
    """
    r = (p - q).clamp_min(0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def residual_one_hot(p: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """residual_distribution(p, one_hot(token)) without materialising the one-hot: zero p[token]."""
    return residual_distribution(p.scatter(-1, token.unsqueeze(-1), 0.0), torch.zeros_like(p))


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from (possibly unnormalised) probs [N, V] by the exponential race.

    argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks i with probability p_i / sum(p) (the
    Gumbel-max trick in another guise); no host sync, unlike torch.multinomial's checks.
    """
    e = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0, generator=generator)
    return (probs.float() / e.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from (possibly unnormalised) probs [N, V] with ONE uniform per row: the first i
    whose cumulative mass exceeds u * total.  Token i owns the interval [c_{i-1}, c_i) of width p_i (up to
    float64 rounding of the cumsum), so a zero-probability token is never drawn.  The draft samples its
    speculations this way: torch.multinomial cost ~13 ms per 16 rows of 49k tokens on a CPU core (most
    of a tree depth), this ~1 ms."""
    c = torch.cumsum(probs.double(), dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, generator=generator, device=probs.device)
    idx = torch.searchsorted(c, u * c[:, -1:], right=True).squeeze(-1)
    over = idx >= probs.shape[-1]  # u * total rounded up to total: take the last token with mass
    if bool(over.any()):
        last = probs.shape[-1] - 1 - torch.flip(probs[over] > 0, dims=[-1]).to(torch.int8).argmax(-1)
        idx[over] = last
    return idx


def _leading_accepts(accepted: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Number of leading True in accepted [B, K], at most cap [B]."""
    n = accepted.to(torch.long).cumprod(dim=-1).sum(dim=-1)
    return torch.minimum(n, cap)


def _caps(max_accept: torch.Tensor | None, drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """Drafts usable per row: min(K, max_accept, leading in-range drafts).

    An out-of-range draft (e.g. -1 padding of a short draft) ends the usable chain exactly like
    max_accept does: it is a forced stop, not a rejection.
    """
    b, k = drafts.shape
    cap = torch.full((b,), k, dtype=torch.long, device=drafts.device)
    if max_accept is not None:
        cap = torch.minimum(cap, max_accept.to(device=drafts.device, dtype=torch.long).clamp_min(0))
    return _leading_accepts((drafts >= 0) & (drafts < vocab), cap)


def _sampled_accepts(
    p: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    q_valid: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """BoolTensor[B, K]: the per-position accept coin of speculative sampling."""
    k = drafts.shape[1]
    p_tok = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # p_{j-1}(d_j)
    if q is None:
        q_tok = torch.ones_like(p_tok)  # one-hot q: q(d_j) = 1 -> accept with prob p(d_j)
    else:
        q_tok = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_tok = torch.where(q_valid.view(-1, 1), q_tok, torch.ones_like(q_tok))
    u = torch.rand(p_tok.shape, generator=generator, device=p.device, dtype=torch.float32)
    # u ~ U[0, 1): P(u < a) = a exactly, so a = 1 always accepts and a = 0 never does.
    return u < accept_probability(p_tok, q_tok)


def _bonus_distribution(
    p_at: torch.Tensor,
    q_at: torch.Tensor | None,
    q_valid: torch.Tensor,
    draft_at: torch.Tensor,
    rejected: torch.Tensor,
) -> torch.Tensor:
    """Distribution [B, V] of the bonus token at each row's stop position.

    Rows stopped by a real rejection use the residual (against their own q, or one-hot(d) for
    deterministic rows); rows that accepted everything they were allowed to use p itself.
    """
    resid = residual_one_hot(p_at, draft_at)
    if q_at is not None:
        resid = torch.where(q_valid.view(-1, 1), residual_distribution(p_at, q_at), resid)
    return torch.where(rejected.view(-1, 1), resid, p_at)


def verify_chain(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    greedy: torch.Tensor,
    target_argmax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    max_accept: torch.Tensor | None = None,
    q_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify B chains of K drafts; returns (accept_lens int32 [B], out_tokens int64 [B, K+1]).

    p: [B, K+1, V] target distributions (``target_probs``), float.
    draft_tokens: [B, K] proposed tokens; entries at positions >= max_accept may be any value, and
        the first out-of-range entry (e.g. -1 padding) acts as max_accept.
    q: [B, K, V] proposal distributions or None (all rows deterministic = one-hot q).
    greedy: [B] bool; greedy rows ignore q and all randomness.
    target_argmax: [B, K+1] argmax of the raw target logits for greedy rows (default argmax p).
    max_accept: [B] cap on accepted drafts (tokens left to generate, short padded drafts).
    q_valid: [B] bool, rows whose q is real; other rows are deterministic (default all True).
    generator: source of all randomness (on p's device); B*K uniforms + B*V exponentials per call.
    """
    b, k1, v = p.shape
    k = k1 - 1
    assert draft_tokens.shape == (b, k), f"draft_tokens {tuple(draft_tokens.shape)} != {(b, k)}"
    assert q is None or q.shape == (b, k, v), f"q {tuple(q.shape)} != {(b, k, v)}"
    device = p.device
    p = p.float()
    drafts = draft_tokens.to(device=device, dtype=torch.long)
    greedy = greedy.to(device=device, dtype=torch.bool)
    cap = _caps(max_accept, drafts, v)
    # Positions >= cap are never looked at; clamp so gathers stay in range for padded drafts.
    drafts_safe = drafts.clamp(0, v - 1)
    if q is not None:
        q = dequantize_proposal(q) if q.dtype == torch.float16 else q.float()
    q_valid = (
        torch.ones(b, dtype=torch.bool, device=device)
        if q_valid is None
        else q_valid.to(device=device, dtype=torch.bool)
    )
    if target_argmax is None:
        target_argmax = p.argmax(dim=-1)
    target_argmax = target_argmax.to(device=device, dtype=torch.long)

    # 1. Accept decisions per position, then the first failure (or the cap) per row.
    greedy_ok = drafts_safe == target_argmax[:, :k]
    sampled_ok = _sampled_accepts(p, drafts_safe, q, q_valid, generator)
    n_acc = _leading_accepts(torch.where(greedy.view(-1, 1), greedy_ok, sampled_ok), cap)

    # 2. Bonus token at position n_acc.  A stop at the cap is NOT a rejection: the chain is then
    #    exactly an SD round with K' = cap drafts that all got accepted, whose bonus is drawn from
    #    p at position cap.  Drawing it from the residual instead would remove the mass
    #    min(p, q) that the (never run) accept test at d_{cap+1} would have emitted -> biased.
    rows = torch.arange(b, device=device)
    rejected = n_acc < cap
    pos_q = n_acc.clamp(max=max(k - 1, 0))  # q / drafts have K positions; only read if rejected
    q_at = q[rows, pos_q] if q is not None and k > 0 else None
    draft_at = drafts_safe[rows, pos_q] if k > 0 else torch.zeros(b, dtype=torch.long, device=device)
    bonus_p = _bonus_distribution(p[rows, n_acc], q_at, q_valid, draft_at, rejected & ~greedy)
    bonus = torch.where(greedy, target_argmax[rows, n_acc], sample_categorical(bonus_p, generator))

    # 3. Pack: accepted drafts, the bonus, then padding.
    return _pack(drafts, n_acc, bonus)


def _pack(drafts: torch.Tensor, n_acc: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accept_lens int32 [B] incl. the bonus, out_tokens [B, K+1]: accepted drafts, bonus, padding)."""
    b, k = drafts.shape
    col = torch.arange(k + 1, device=drafts.device).view(1, -1)
    out = torch.cat([drafts, torch.zeros(b, 1, dtype=torch.long, device=drafts.device)], dim=1)
    out = torch.where(col < n_acc.view(-1, 1), out, torch.full_like(out, PAD_TOKEN))
    out = out.scatter(1, n_acc.view(-1, 1), bonus.reshape(-1, 1))
    return (n_acc + 1).to(torch.int32), out


def verify_chain_greedy(
    draft_tokens: torch.Tensor,
    target_argmax: torch.Tensor,
    vocab: int,
    max_accept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_chain`` for a batch whose rows are ALL greedy, from the target's argmax alone.

    Same result as ``verify_chain(..., greedy=all True)`` (accept while d_j == argmax_j, bonus =
    argmax at the first mismatch or the cap), without the [B, K+1, V] target distributions,
    the residuals or any random draw: the worker's all-greedy rounds skip ``target_probs``.
    """
    k = draft_tokens.shape[1]
    drafts = draft_tokens.to(device=target_argmax.device, dtype=torch.long)
    target_argmax = target_argmax.to(torch.long)
    cap = _caps(max_accept, drafts, vocab)
    n_acc = _leading_accepts(drafts == target_argmax[:, :k], cap)
    return _pack(drafts, n_acc, target_argmax.gather(1, n_acc.view(-1, 1)))
