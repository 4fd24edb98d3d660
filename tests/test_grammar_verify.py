"""Grammar-constrained chain verify at T = 1 is exact: the committed tokens follow the grammar-masked
target distribution, with SGLang's real xgrammar backend and the real SmolLM2 tokenizer.

A draft that proposes forbidden tokens (and the target, unmasked, would pick them too) runs through
``mask_chain_logits`` (SGLang's build_grammar_vocab_mask over a linear chain) and the exact
``verify_chain``, round after round, the FSM advanced by the committed tokens as SGLang's result
processing does.  The regex's second-digit set depends on the first digit, so a mask computed in
the wrong grammar state shows up as forbidden pairs and a wrong distribution: the negative control
(every row masked in the committed state, the draft's tokens not walked) is caught."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_ssd.saguaro.verify import verify_chain
from sglang_ssd.sglang.grammar import mask_chain_logits

REGEX = "0[01]|1[12]|2[02]"
ALLOWED = {"0": "01", "1": "12", "2": "02"}  # second digit allowed after the first
K = 3
TRIALS = 3000
CHUNK = 250


@pytest.fixture(scope="module")
def grammar_env(target_path):
    from transformers import AutoTokenizer
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    tok = AutoTokenizer.from_pretrained(target_path)
    vocab = len(tok)
    backend = XGrammarGrammarBackend(tok, vocab_size=vocab, model_eos_token_ids=[tok.eos_token_id])
    proto = backend.dispatch_regex(REGEX)
    digits = [tok.convert_tokens_to_ids(c) for c in "0123"]
    assert len(set(digits)) == 4 and all(d is not None and d >= 0 for d in digits)
    cand = digits + [tok.eos_token_id, tok.convert_tokens_to_ids("a")]  # '3' and 'a' are never allowed
    return SimpleNamespace(tok=tok, vocab=vocab, proto=proto, cand=torch.tensor(cand), names=list("0123") + ["<eos>", "a"])


def _row0_only_mask(batch, chain, logits, barrier=None):
    """Negative control: the committed state's mask on every row (drafted tokens not walked)."""
    n = chain.shape[1]
    for i, req in enumerate(batch.reqs):
        m = req.grammar.allocate_vocab_mask(vocab_size=logits.shape[-1], batch_size=1, device="cpu")
        req.grammar.fill_vocab_mask(m, 0)
        req.grammar.apply_vocab_mask(logits[i * n:(i + 1) * n], m.expand(n, -1).contiguous())
    return True


def _simulate(env, mask_fn, seed: int) -> dict[tuple[str, str], int]:
    """TRIALS requests decoded to two committed tokens; returns counts of (first, second)."""
    g = torch.Generator().manual_seed(seed)
    c = len(env.cand)
    # target logits by absolute position (row j of a request with m committed tokens reads L[m + j]);
    # unmasked it would like the forbidden '3' and 'a' best
    L = torch.tensor([[0.3, 1.0, -0.4, 2.0, -1.0, 1.5]] * 2 + [[0.0, 0.2, 0.1, 0.5, 0.8, 0.3]] * (K + 2))
    q = torch.tensor([0.2, 0.15, 0.15, 0.3, 0.05, 0.15]).expand(K, c)  # the draft proposes forbidden tokens too
    counts: dict[tuple[str, str], int] = {}
    for start in range(0, TRIALS, CHUNK):
        b = min(CHUNK, TRIALS - start)
        reqs = [SimpleNamespace(grammar=env.proto.copy()) for _ in range(b)]
        done = [[] for _ in range(b)]
        while any(len(d) < 2 for d in done):
            live = [i for i in range(b) if len(done[i]) < 2]
            drafts = torch.multinomial(q.repeat(len(live), 1), 1, generator=g).view(len(live), K)
            root = torch.full((len(live), 1), int(env.cand[5]))  # any committed token: the FSM is past it
            chain = torch.cat([root, env.cand[drafts]], dim=1)
            logits = torch.full((len(live) * (K + 1), env.vocab), -math.inf)
            rows = torch.stack([L[len(done[i]):len(done[i]) + K + 1] for i in live]).view(-1, c)
            logits[:, env.cand] = rows
            batch = SimpleNamespace(has_grammar=True, reqs=[reqs[i] for i in live],
                                    sampling_info=SimpleNamespace(vocab_size=env.vocab, grammar_mask=None))
            assert mask_fn(batch, chain, logits)
            p = torch.softmax(logits[:, env.cand], dim=-1).view(len(live), K + 1, c)
            accept, out = verify_chain(p, drafts, q.expand(len(live), K, c).contiguous(),
                                       torch.zeros(len(live), dtype=torch.bool), generator=g)
            for r, i in enumerate(live):
                for tok in out[r, : int(accept[r])].tolist():
                    if len(done[i]) < 2:
                        done[i].append(env.names[tok])
                        # SGLang's advance_grammar_fsm; a forbidden token would raise here
                        if not reqs[i].grammar.is_terminated():
                            try:
                                reqs[i].grammar.accept_token(int(env.cand[tok]))
                            except ValueError:
                                pass  # counted below as a forbidden pair
        for d in done:
            counts[tuple(d)] = counts.get(tuple(d), 0) + 1
    return counts


def _expected() -> dict[tuple[str, str], float]:
    l0 = {"0": 0.3, "1": 1.0, "2": -0.4}
    l1 = {"0": 0.3, "1": 1.0, "2": -0.4}
    z0 = sum(math.exp(v) for v in l0.values())
    out = {}
    for a, va in l0.items():
        z1 = sum(math.exp(l1[b]) for b in ALLOWED[a])
        for b in ALLOWED[a]:
            out[(a, b)] = math.exp(va) / z0 * math.exp(l1[b]) / z1
    return out


def _chi2_pvalue(counts, expected) -> float:
    """Goodness of fit over the allowed pairs; any other pair (forbidden) gives p = 0."""
    if any(k not in expected for k in counts):
        return 0.0
    n = sum(counts.values())
    stat = sum((counts.get(k, 0) - n * e) ** 2 / (n * e) for k, e in expected.items())
    from scipy.stats import chi2

    return float(chi2.sf(stat, len(expected) - 1))


def test_constrained_verify_follows_masked_target(grammar_env):
    exp = _expected()
    counts = _simulate(grammar_env, mask_chain_logits, seed=1)
    assert set(counts) <= set(exp), f"forbidden sequences committed: {set(counts) - set(exp)}"
    assert _chi2_pvalue(counts, exp) > 1e-3, (counts, exp)


def test_negative_control_wrong_state_mask_is_caught(grammar_env):
    counts = _simulate(grammar_env, _row0_only_mask, seed=1)
    assert _chi2_pvalue(counts, _expected()) < 1e-6, counts
    assert set(counts) - set(_expected()), "the control should commit forbidden pairs"


def test_unconstrained_requests_in_a_constrained_batch_are_untouched(grammar_env):
    env = grammar_env
    chain = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    logits = torch.randn(2 * (K + 1), env.vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    batch = SimpleNamespace(has_grammar=True, reqs=[SimpleNamespace(grammar=None), SimpleNamespace(grammar=env.proto.copy())],
                            sampling_info=SimpleNamespace(vocab_size=env.vocab, grammar_mask=None))
    assert mask_chain_logits(batch, chain, logits)
    assert torch.equal(logits[: K + 1], before[: K + 1])  # the unconstrained request: all rows as they were
    allowed0 = torch.isfinite(logits[K + 1])
    assert set(allowed0.nonzero().view(-1).tolist()) == {int(env.cand[i]) for i in range(3)}
    assert not mask_chain_logits(SimpleNamespace(has_grammar=False), chain, logits)


def test_greedy_constrained_chain_stops_at_the_grammar_end(grammar_env):
    """Greedy rows: the committed tokens are the argmax of the MASKED rows (unmasked, the target prefers
    the forbidden '3'), and once the regex is complete only EOS is allowed, so a round whose drafts run
    past the end commits '1', '1', EOS (argmax of L0 over {0,1,2} is '1'; after '1' the set is {1,2})."""
    env = grammar_env
    c = len(env.cand)
    L = torch.tensor([0.3, 1.0, -0.4, 2.0, -1.0, 1.5]).expand(K + 1, c)  # every position prefers '3'
    grammar = env.proto.copy()
    batch = SimpleNamespace(has_grammar=True, reqs=[SimpleNamespace(grammar=grammar)],
                            sampling_info=SimpleNamespace(vocab_size=env.vocab, grammar_mask=None))
    # drafts '1', '1', EOS: all allowed, so all are accepted and the bonus comes after EOS
    drafts = torch.tensor([[1, 1, 4]])
    chain = torch.cat([env.cand[5].view(1, 1), env.cand[drafts]], dim=1)
    logits = torch.full((K + 1, env.vocab), -math.inf)
    logits[:, env.cand] = L
    assert mask_chain_logits(batch, chain, logits)
    p = torch.softmax(logits[:, env.cand], dim=-1)[None]
    argmax = p.argmax(-1)
    accept, out = verify_chain(p, drafts, None, torch.ones(1, dtype=torch.bool), target_argmax=argmax)
    assert out[0, :3].tolist() == [1, 1, 4] and int(accept[0]) == K + 1
    assert argmax[0, :3].tolist() == [1, 1, 4]  # masked rows: '1', then '1' of {1, 2}, then only EOS
    # a draft that breaks the grammar ('3' first) is rejected at once; the bonus is the masked argmax
    drafts = torch.tensor([[3, 1, 4]])
    chain = torch.cat([env.cand[5].view(1, 1), env.cand[drafts]], dim=1)
    logits = torch.full((K + 1, env.vocab), -math.inf)
    logits[:, env.cand] = L
    mask_chain_logits(batch, chain, logits)
    p = torch.softmax(logits[:, env.cand], dim=-1)[None]
    accept, out = verify_chain(p, drafts, None, torch.ones(1, dtype=torch.bool), target_argmax=p.argmax(-1))
    assert int(accept[0]) == 1 and out[0, 0].item() == 1
