"""Fast backup speculator: prompt lookup / n-gram copying over a request's own tokens (notes 2.8).

Find the longest suffix n-gram of the context (n from max_n down to min_n) that occurred earlier,
preferring the most recent occurrence, and copy the tokens that followed it.  If the copy source
runs into the end of the context it continues over the tokens just proposed (``self_extend``,
which turns a repeated pattern into its periodic continuation); with ``self_extend=False`` it
stops there.  Positions left without a copy are filled with uniform random tokens.

Proposal distribution q for exact verification (notes 2.7):
* a copied token is a deterministic function of the context and the earlier proposed tokens
  -> q(. | prefix) = one-hot(token);
* a random token is drawn uniformly, independent of everything else -> q = 1/V (or, drawn from a
  reduced draft head's W ids, 1/W on them and 0 elsewhere).
``proposal_rows`` builds these rows; passing them to ``verify_chain`` keeps sampling exact
(q = one-hot is also what ``q=None`` / ``q_valid=False`` rows mean there).  Using the uniform row for
random tokens rather than one-hot is exact too and accepts more often: min(1, V p(d)) >= p(d)
(min(1, W p(d)) for a token drawn uniformly from a reduced head's W ids).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def _check_n(max_n: int, min_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


def find_match(tokens: Sequence[int], max_n: int, min_n: int = 1) -> tuple[int, int]:
    """(n, e): the longest n in [min_n, max_n] such that the suffix tokens[L-n:] also ends at an
    earlier position e < L (tokens[e-n:e] == suffix), the most recent such e; (0, -1) if none.
    tokens[e] is the first token to copy.  O(L * max_n)."""
    _check_n(max_n, min_n)
    n_len = len(tokens)
    best_n, best_e = 0, -1
    for e in range(n_len - 1, 0, -1):  # most recent first; e = L is the suffix itself
        m = 0
        while m < max_n and m < e and tokens[e - 1 - m] == tokens[n_len - 1 - m]:
            m += 1
        if m > best_n:  # strictly longer: keeps the most recent among equal lengths
            best_n, best_e = m, e
            if m == max_n:
                break
    return (best_n, best_e) if best_n >= min_n else (0, -1)


def _copy(tokens: Sequence[int], e: int, k: int, self_extend: bool) -> list[int]:
    """Up to k tokens starting at source position e; sources past the context read the copy."""
    out: list[int] = []
    n_len = len(tokens)
    for i in range(k):
        s = e + i
        if s < n_len:
            out.append(int(tokens[s]))
        elif self_extend:
            out.append(out[s - n_len])  # s - L < i because e < L: already proposed
        else:
            break
    return out


def _pad(proposed: list[int], k: int, vocab_size: int, generator: Optional[torch.Generator],
         ids: Optional[torch.Tensor] = None) -> tuple[list[int], list[bool]]:
    """Fill up to k with random tokens: uniform over the vocabulary, or over ``ids`` when given (a reduced
    draft head's ids: q then stays inside them, and so does the reply's sparse q)."""
    n_rand = k - len(proposed)
    is_random = [False] * len(proposed) + [True] * n_rand
    if n_rand > 0:
        n = vocab_size if ids is None else int(ids.numel())
        r = torch.randint(0, n, (n_rand,), generator=generator)
        proposed = proposed + (r if ids is None else ids.cpu()[r]).tolist()
    return proposed, is_random


class NgramSpeculator:
    """Stateless n-gram speculator (scans the context each call)."""

    def __init__(self, max_n: int = 4, min_n: int = 1, self_extend: bool = True):
        _check_n(max_n, min_n)
        self.max_n, self.min_n, self.self_extend = max_n, min_n, self_extend

    def propose(self, tokens: Sequence[int], k: int, vocab_size: int,
                generator: Optional[torch.Generator] = None) -> tuple[list[int], list[bool]]:
        """-> (k proposed tokens, is_random per position).  Random tokens use `generator`."""
        n, e = find_match(tokens, self.max_n, self.min_n)
        copied = _copy(tokens, e, k, self.self_extend) if n > 0 else []
        return _pad(copied, k, vocab_size, generator)


class NgramIndex:
    """Incremental per-request index: same proposals as ``NgramSpeculator``, O(max_n) per call.

    index[n][ngram] = most recent end e (exclusive) of that n-gram among those followed by at
    least one token, i.e. registered when tokens[e] is appended.  Memory O(L (max_n - min_n + 1)).
    """

    def __init__(self, max_n: int = 4, min_n: int = 1, self_extend: bool = True,
                 tokens: Sequence[int] = ()):
        _check_n(max_n, min_n)
        self.max_n, self.min_n, self.self_extend = max_n, min_n, self_extend
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        e = len(self.tokens)  # the new token sits at e: n-grams ending (exclusive) at e now have a successor
        for n in range(self.min_n, min(self.max_n, e) + 1):
            self.index[n][tuple(self.tokens[e - n:e])] = e
        self.tokens.append(int(token))

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def _find(self, tail: Sequence[int], n_len: int) -> tuple[int, int]:
        """(n, e): the longest indexed suffix n-gram of a context of n_len tokens whose last tokens are
        ``tail`` (at least its last max_n, or all of it), the most recent end e; (0, -1) if none."""
        for n in range(min(self.max_n, n_len - 1), self.min_n - 1, -1):
            e = self.index[n].get(tuple(tail[len(tail) - n:]))
            if e is not None:
                return n, e
        return 0, -1

    def match(self) -> tuple[int, int]:
        """(n, e) as ``find_match(self.tokens, max_n, min_n)``."""
        return self._find(self.tokens[-self.max_n:], len(self.tokens))

    def propose(self, k: int, vocab_size: int, generator: Optional[torch.Generator] = None,
                ids: Optional[torch.Tensor] = None) -> tuple[list[int], list[bool]]:
        n, e = self.match()
        copied = _copy(self.tokens, e, k, self.self_extend) if n > 0 else []
        return _pad(copied, k, vocab_size, generator, ids)

    def propose_after(self, extra: Sequence[int], k: int, vocab_size: int,
                      generator: Optional[torch.Generator] = None,
                      ids: Optional[torch.Tensor] = None) -> tuple[list[int], list[bool]]:
        """As ``propose`` for the context tokens + extra, leaving the index as it is (extra = tokens
        already proposed this round by someone else).  The same proposal as NgramSpeculator over
        tokens + extra, except that only n-grams followed by a context token are copy sources."""
        ext = list(self.tokens) + [int(t) for t in extra]
        n, e = self._find(ext[-self.max_n:], len(ext))
        return _pad(_copy(ext, e, k, self.self_extend) if n else [], k, vocab_size, generator, ids)

    def match_tail(self, extra: Sequence[int] = ()) -> tuple[int, int]:
        """(n, token): the n-gram match for the context tokens + extra, as ``propose_after``'s first copied
        token, in O(max_n) (only the last max_n tokens of tokens + extra are read); (0, -1) if none."""
        tail = (self.tokens[-self.max_n:] + [int(t) for t in extra[-self.max_n:]])[-self.max_n:]
        n, e = self._find(tail, len(self.tokens) + len(extra))
        return (n, self.tokens[e]) if n else (0, -1)


def proposal_rows(tokens: Sequence[int], is_random: Sequence[bool], vocab_size: int,
                  dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                  ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """True proposal q [k, V] of an n-gram proposal: one-hot(token) for copies, uniform for random tokens
    (1/V, or 1/len(ids) at ``ids`` and 0 elsewhere when they were drawn from ids)."""
    k = len(tokens)
    q = torch.zeros(k, vocab_size, dtype=dtype, device=device)
    rand = torch.as_tensor(list(is_random), dtype=torch.bool, device=device).view(k, 1)
    q.scatter_(1, torch.as_tensor(list(tokens), dtype=torch.long, device=device).view(k, 1), 1.0)
    if ids is None:
        uniform = torch.full_like(q[:1], 1.0 / vocab_size)
    else:
        uniform = torch.zeros_like(q[:1]).index_fill_(1, ids.to(device=q.device), 1.0 / int(ids.numel()))
    return torch.where(rand, uniform, q)
