"""Corpus lookup (a REST-style datastore): the target's usual continuation of a long n-gram, learned from the
target's own generated answers, for the tokens where the small draft is unsure.

The draft's own prompt lookup (lookup.py) copies from the request's context; this one copies from a corpus of
the target's answers to other prompts (assets/gen: 5.5M generated positions).  For n in ``ns`` (longest first)
the store maps the hash of an n-gram to the token that followed it most often in the corpus, kept only when
that token followed it in at least ``min_share`` of its occurrences.  The draft's greedy rows take the
continuation of the longest stored suffix of their context when their top probability is below ``max_p``
and the request's own lookup did not already replace the token (draft/lookup.py).

Measured offline (default draft, eighth pass; rounds of a K = 3 chain simulated along target-greedy
trajectories, each round starting after the previous one's bonus token; scripts/lookup_offline.py,
results/lookup_offline.md):

  ========================================  ==========  ===============  ====================
  trajectories                              draft only  + prompt lookup  + corpus (6/8, 0.6, 0.7)
  ========================================  ==========  ===============  ====================
  held-out 20 prompts                       1.868       1.944            2.015
  all 64 bench prompts (EOS ignored)        1.807       1.901            1.942
  third-pool T = 0 answers left out of it   1.775       2.094            2.160
  ========================================  ==========  ===============  ====================

(n, share, max_p) were chosen over n >= 3..8, share 0.5-0.9, max_p 0.3-1 on the last two rows (the corpus
then left those answers out); shorter n-grams copy phrases the draft already knows.

Exactness: greedy rows are verified by token equality with the target's argmax, so any proposal leaves the
output unchanged; sampled rows never read the store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

FILE_NAME = "datastore.npz"   # in a draft's model directory: the store its draft process loads
NS = (6, 8)                   # n-gram lengths stored (the longest stored suffix is used)
MIN_SHARE = 0.6               # a continuation is kept when it followed its n-gram at least this often
MAX_P = 0.7                   # the draft's top probability below which its greedy token yields to the store
_P = 1000003                  # hash multiplier (mod 2^64)
_MASK = (1 << 64) - 1


def hash_ngrams(tokens: np.ndarray, n: int) -> np.ndarray:
    """uint64 [len - n + 1]: h[i] = hash of tokens[i:i+n] (polynomial in tokens + 1, mod 2^64)."""
    t = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
    h = np.zeros(len(t) - n + 1, dtype=np.uint64)
    for j in range(n):
        h = h * np.uint64(_P) + t[j: len(t) - n + 1 + j]
    return h


def hash_tail(tokens: Sequence[int], n: int) -> int:
    """The hash_ngrams value of the last n tokens, in Python ints (same value)."""
    h = 0
    for t in tokens[len(tokens) - n:]:
        h = (h * _P + int(t) + 1) & _MASK
    return h


class Datastore:
    """keys[n]: sorted uint64 hashes of stored n-grams; tokens[n]: the continuation of each."""

    def __init__(self, keys: dict[int, np.ndarray], tokens: dict[int, np.ndarray], min_share: float = MIN_SHARE):
        if sorted(keys) != sorted(tokens) or not keys:
            raise ValueError("datastore: keys and tokens must cover the same, non-empty set of n")
        self.ns = tuple(sorted(keys, reverse=True))
        self.keys, self.tokens, self.min_share = keys, tokens, min_share

    @classmethod
    def build(cls, seqs: Iterable[tuple[np.ndarray, int]], ns: Sequence[int] = NS,
              min_share: float = MIN_SHARE) -> "Datastore":
        """seqs: (tokens of prompt + answer, prompt length); only answer tokens are continuations."""
        ks: dict[int, list] = {n: [] for n in ns}
        vs: dict[int, list] = {n: [] for n in ns}
        for toks, plen in seqs:
            toks = np.asarray(toks, dtype=np.int64)
            for n in ns:
                first = max(n, int(plen))  # position of the first continuation that has n tokens before it
                if len(toks) <= first:
                    continue
                ks[n].append(hash_ngrams(toks[first - n: len(toks) - 1], n))
                vs[n].append(toks[first:])
        keys, tokens = {}, {}
        for n in ns:
            k = np.concatenate(ks[n]) if ks[n] else np.zeros(0, np.uint64)
            v = np.concatenate(vs[n]) if vs[n] else np.zeros(0, np.int64)
            o = np.lexsort((v, k))
            k, v = k[o], v[o]
            pair = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (v[1:] != v[:-1])]) if len(k) else o[:0]
            cnt = np.diff(np.r_[pair, len(k)])
            pk, pv = k[pair], v[pair]
            o = np.lexsort((-cnt, pk))  # per key, its most frequent continuation first (smallest id on ties)
            pk, pv, cnt = pk[o], pv[o], cnt[o]
            first = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]]) if len(pk) else o[:0]
            total = np.add.reduceat(cnt, first) if len(first) else cnt[:0]
            keep = first[cnt[first] >= min_share * total]
            keys[n], tokens[n] = pk[keep], pv[keep].astype(np.int32)
        return cls(keys, tokens, min_share)

    def save(self, path: Path | str) -> None:
        arrays = {f"keys_{n}": self.keys[n] for n in self.ns}
        arrays.update({f"tokens_{n}": self.tokens[n] for n in self.ns})
        np.savez(path, min_share=np.float64(self.min_share), **arrays)

    @classmethod
    def load(cls, path: Path | str) -> "Datastore":
        with np.load(path) as z:
            ns = sorted(int(f[5:]) for f in z.files if f.startswith("keys_"))
            return cls({n: z[f"keys_{n}"] for n in ns}, {n: z[f"tokens_{n}"] for n in ns}, float(z["min_share"]))

    def __len__(self) -> int:
        return sum(len(k) for k in self.keys.values())

    def next_token(self, tokens: Sequence[int]) -> Optional[tuple[int, int]]:
        """(n, token): the stored continuation of the longest stored suffix n-gram of tokens, or None.
        Only the last max(ns) tokens are read."""
        for n in self.ns:
            if len(tokens) < n:
                continue
            keys = self.keys[n]
            h = np.uint64(hash_tail(tokens, n))
            i = int(np.searchsorted(keys, h))
            if i < len(keys) and keys[i] == h:
                return n, int(self.tokens[n][i])
        return None


def load_for(model_dir: Optional[str]) -> Optional[Datastore]:
    """The store shipped in a draft's model directory, or None (a draft without one)."""
    if model_dir is None:
        return None
    path = Path(model_dir) / FILE_NAME
    return Datastore.load(path) if path.is_file() else None
