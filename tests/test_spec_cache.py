"""Speculation cache keying, one-round lifetime and counters."""

from __future__ import annotations

import pytest
import torch

from sglang_ssd.draft.spec_cache import SpecCache


def _fill(cache: SpecCache, rid: str, temp: float = 0.0, k: int = 3, v: int = 10):
    keys = [(0, 5), (0, 7), (1, 5), (3, 2)]
    toks = torch.arange(len(keys) * k).view(len(keys), k)
    q16 = torch.rand(len(keys), k, v).half() if temp > 0 else None
    cache.put(rid, keys, toks, q16, temp)
    return keys, toks, q16


def test_keying_is_exact_on_rid_k_bonus():
    c = SpecCache()
    keys, toks, _ = _fill(c, "a")
    _fill(c, "b")
    assert c.keys("a") == keys and c.num_entries() == 8
    for i, (k, b) in enumerate(keys):
        assert torch.equal(c.peek("a", k, b).tokens, toks[i])
    # same bonus at another glue index is a different key; (1, 7) was never cached
    assert c.peek("a", 1, 7) is None and c.peek("a", 2, 5) is None and c.peek("zz", 0, 5) is None
    e = c.take("a", 1, 5, 0.0)
    assert torch.equal(e.tokens, toks[2]) and e.q16 is None


def test_take_consumes_the_round_and_counts():
    c = SpecCache()
    _fill(c, "a")
    _fill(c, "b")
    assert c.take("a", 0, 7, 0.0) is not None
    assert c.take("a", 0, 7, 0.0) is None            # lives exactly one round
    assert c.take("b", 2, 2, 0.0) is None            # miss also consumes b's round
    assert c.keys("b") == []
    assert c.take("c", -1, 3, 0.0) is None           # never built: forced miss
    assert (c.total.hits, c.total.misses, c.total.forced_misses) == (1, 3, 2)
    assert (c.per_request["a"].hits, c.per_request["a"].misses) == (1, 1)
    assert c.per_request["b"].misses == 1


def test_k_minus_one_and_temperature_change_miss():
    c = SpecCache()
    _fill(c, "a", temp=1.0)
    assert c.take("a", -1, 5, 1.0) is None and c.total.forced_misses == 1
    _fill(c, "a", temp=1.0)
    assert c.take("a", 0, 5, 0.5) is None            # built at T = 1, asked at T = 0.5
    keys, toks, q16 = _fill(c, "a", temp=1.0)
    e = c.take("a", 3, 2, 1.0)
    assert torch.equal(e.q16, q16[3]) and e.q16.dtype == torch.float16


def test_put_replaces_and_drop_forgets():
    c = SpecCache()
    _fill(c, "a")
    c.put("a", [(2, 9)], torch.zeros(1, 3, dtype=torch.long), None, 0.0)
    assert c.keys("a") == [(2, 9)]
    c.take("a", 2, 9, 0.0)
    c.drop("a")
    assert "a" not in c.per_request and c.keys("a") == []
    with pytest.raises(ValueError):
        c.put("a", [(0, 1), (0, 1)], torch.zeros(2, 3, dtype=torch.long), None, 0.0)
    with pytest.raises(ValueError):
        c.put("a", [(0, 1)], torch.zeros(2, 3, dtype=torch.long), None, 0.0)
    assert c.nbytes() == 0
