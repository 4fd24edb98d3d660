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


CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from (possibly unnormalised) probs [N, V] with ONE uniform per row: the first i
    whose cumulative mass exceeds u * total.  Token i owns the interval [c_{i-1}, c_i) of width p_i (up to
    float64 rounding of the sums), so a zero-probability token is never drawn.  The draft samples its
    speculations this way and the verifier its bonus: torch.multinomial cost ~13 ms per 16 rows of 49k
    tokens on a CPU core, B x V exponentials ~6 ms per 8 rows.

    Two levels, since a float64 cumsum over the whole row is slow on a CPU core (~2.5 ms for 8 x 49k):
    block sums of CDF_BLOCK tokens (one vectorised reduction), the block holding u * total by their
    cumsum, then the cumsum of that one block per row."""
    n, v = probs.shape
    u = torch.rand(n, 1, dtype=torch.float64, generator=generator, device=probs.device)
    if v <= 2 * CDF_BLOCK:
        blocks, width = probs.double().unsqueeze(1), v
    else:
        nb = -(-v // CDF_BLOCK)
        padded = torch.nn.functional.pad(probs, (0, nb * CDF_BLOCK - v)) if nb * CDF_BLOCK > v else probs
        blocks, width = padded.reshape(n, nb, CDF_BLOCK), CDF_BLOCK
    block_mass = blocks.sum(dim=-1, dtype=torch.float64)  # [N, nb]
    block_cum = torch.cumsum(block_mass, dim=-1)
    target = u * block_cum[:, -1:]
    blk = torch.searchsorted(block_cum, target, right=True)  # [N, 1]
    past = blk.squeeze(1) >= block_cum.shape[1]  # u * total rounded up to total: the last block with mass
    if bool(past.any()):
        nb = block_mass.shape[1]
        blk[past, 0] = nb - 1 - torch.flip(block_mass[past] > 0, dims=[-1]).to(torch.int8).argmax(-1)
    before = torch.where(blk > 0, block_cum.gather(1, (blk - 1).clamp_min(0)), torch.zeros_like(target))
    rows = torch.arange(n, device=probs.device)
    inner = blocks[rows, blk.squeeze(1)].double()  # [N, width]: the chosen block of each row
    j = torch.searchsorted(torch.cumsum(inner, dim=-1), target - before, right=True).squeeze(-1)
    # rounding (u * total up to total, a block's sum above its own cumsum's last value): the chosen
    # block's last token with mass (the block has mass: block_cum rises at it)
    over = j >= width
    if bool(over.any()):
        j[over] = width - 1 - torch.flip(inner[over] > 0, dims=[-1]).to(torch.int8).argmax(-1)
    return blk.squeeze(1) * width + j


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


def verify_chain_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    draft_tokens: torch.Tensor,
    q16: torch.Tensor | None,
    greedy: torch.Tensor,
    target_argmax: torch.Tensor,
    generator: torch.Generator | None = None,
    max_accept: torch.Tensor | None = None,
    q_valid: torch.Tensor | None = None,
    q_sums: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_chain`` for rows whose target distribution is the plain softmax(logits / T) (no top-k,
    top-p or min-p; greedy rows may be mixed in), computing p only where the rule reads it.

    The rule needs p(d_j) at the K drafts of each row and the full p at ONE position per row (the
    stop, for the bonus), not the [B, K+1, V] table: p(d_j) = exp(z(d_j) - logsumexp(z)) with
    z = logits / T, and the stop row's p = softmax(z) as ``target_probs`` builds it.  q16 (the wire
    copy, [B, K, V] float16) is read the way dequantize_proposal reads it, at the drafts and at the stop
    row only: each value over its row's exact float64 sum, so a value taken alone equals that value of
    the whole dequantised row bit for bit (q_sums: those sums as float32, [B, K], when the caller has
    them from the sparse wire form).  The bonus is one inverse-CDF draw per row from the unnormalised
    residual (the same law as its normalised form).

    logits: [B, K+1, V] processed logits (penalties, bias, grammar masks applied); temperature [B]
    (ignored on greedy rows); target_argmax [B, K+1]; the rest as ``verify_chain``.
    """
    b, k1, v = logits.shape
    k = k1 - 1
    assert draft_tokens.shape == (b, k), f"draft_tokens {tuple(draft_tokens.shape)} != {(b, k)}"
    assert q16 is None or q16.shape == (b, k, v), f"q {tuple(q16.shape)} != {(b, k, v)}"
    device = logits.device
    greedy = greedy.to(device=device, dtype=torch.bool)
    drafts = draft_tokens.to(device=device, dtype=torch.long)
    cap = _caps(max_accept, drafts, v)
    drafts_safe = drafts.clamp(0, v - 1)
    q_valid = (torch.ones(b, dtype=torch.bool, device=device) if q_valid is None
               else q_valid.to(device=device, dtype=torch.bool))
    target_argmax = target_argmax.to(device=device, dtype=torch.long)
    t = torch.where(greedy, torch.ones_like(temperature), temperature.reshape(-1).float().to(device)).view(b, 1)
    rows = torch.arange(b, device=device)
    if q16 is not None and q_sums is None:
        q_sums = q16.sum(dim=-1, dtype=torch.float64).to(torch.float32)
    if q_sums is not None:
        q_sums = q_sums.to(device).clamp_min(1e-30)

    # 1. accept coins from p(d_j) and q(d_j) alone
    z = logits[:, :k].float() / t.unsqueeze(-1)  # Sampler.forward: logits.div_(T), then softmax
    p_tok = torch.exp(z.gather(-1, drafts_safe.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1))
    del z
    if q16 is None:
        q_tok = torch.ones_like(p_tok)
    else:
        q_tok = q16.gather(-1, drafts_safe.unsqueeze(-1)).squeeze(-1).to(torch.float32) / q_sums
        q_tok = torch.where(q_valid.view(-1, 1), q_tok, torch.ones_like(q_tok))
    u = torch.rand(p_tok.shape, generator=generator, device=device, dtype=torch.float32)
    sampled_ok = u < accept_probability(p_tok, q_tok)
    greedy_ok = drafts_safe == target_argmax[:, :k]
    n_acc = _leading_accepts(torch.where(greedy.view(-1, 1), greedy_ok, sampled_ok), cap)

    # 2. the bonus from the stop row's p: after a real rejection the residual max(0, p - q) (one-hot q:
    #    p without the draft), else p itself; an all-zero residual (p == q) falls back to p
    rejected = (n_acc < cap) & ~greedy
    p_at = torch.softmax(logits[rows, n_acc].float() / t, dim=-1)
    weights = p_at
    if k > 0 and bool(rejected.any()):
        pos_q = n_acc.clamp(max=k - 1)
        q_at = None if q16 is None else q16[rows, pos_q].to(torch.float32) / q_sums[rows, pos_q].unsqueeze(-1)
        weights = _bonus_weights(p_at, q_at, q_valid, drafts_safe[rows, pos_q], rejected)
    bonus = torch.where(greedy, target_argmax[rows, n_acc], sample_inverse_cdf(weights, generator))
    return _pack(drafts, n_acc, bonus)


def _bonus_weights(p_at: torch.Tensor, q_at: torch.Tensor | None, q_valid: torch.Tensor, draft_at: torch.Tensor,
                   rejected: torch.Tensor) -> torch.Tensor:
    """``_bonus_distribution`` unnormalised (for sample_inverse_cdf): max(0, p - q) on rejected rows with
    q, p without the draft on rejected deterministic rows, p elsewhere and where the residual is all 0."""
    resid = p_at.scatter(-1, draft_at.unsqueeze(-1), 0.0)
    if q_at is not None:
        resid = torch.where(q_valid.view(-1, 1), (p_at - q_at).clamp_min_(0.0), resid)
    return torch.where(rejected.view(-1, 1) & (resid.sum(-1, keepdim=True) > 0), resid, p_at)


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
