"""target_dist must reproduce the distribution SGLang's non-speculative sampler draws from.

Reference: importing ``sglang.srt.layers.sampler`` on CPU needs the triton/sgl_kernel stand-ins and
~25 s, so instead the tests pull SGLang's *own source* out of the installed wheel with ``ast`` and
execute just the pieces that define the distribution:

* ``top_k_top_p_min_p_sampling_from_probs_torch`` (sglang/srt/layers/sampler.py, pytorch backend);
* the temperature / top_k special cases of ``SamplingParams.__post_init__``
  (sglang/srt/sampling/sampling_params.py) and the ``is_all_greedy`` expression of
  ``SamplingBatchInfo.from_schedule_batch`` (sglang/srt/sampling/sampling_batch_info.py).

The two lines before the filter (``logits.div_(temperatures)``; ``sampler_softmax`` which is
``torch.softmax`` on CPU) sit inside ``Sampler.forward`` and are replicated here.  When the sglang
wheel is absent, a transcription of the filter (``_transcribed_filter``) stands in.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import types
from functools import lru_cache
from typing import Callable, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ssd.saguaro.target_dist import (
    SAMPLING_EPS,
    TOP_K_ALL,
    effective_top_k,
    filter_probs,
    is_greedy,
    sampler_filter_order,
    target_probs,
)


# ----------------------------------------------------------------------------- SGLang source
def _sglang_root() -> pathlib.Path | None:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


SGLANG = _sglang_root()


def _module_ast(rel: str) -> ast.Module:
    return ast.parse((SGLANG / rel).read_text())


def _function_from_source(rel: str, name: str, namespace: dict) -> Callable:
    tree = _module_ast(rel)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    exec(compile(ast.Module(body=[node], type_ignores=[]), rel, "exec"), namespace)
    return namespace[name]


def _transcribed_filter(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions,
                        *, return_filtered_probs=False, max_top_k=None):
    """Copy of SGLang 0.5.23 top_k_top_p_min_p_sampling_from_probs_torch (unseeded branch)."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[torch.arange(0, probs_sort.shape[-1]).view(1, -1) >= top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
    if need_min_p_sampling:
        probs_sort[probs_sort < (probs_sort[:, 0] * min_ps).view(-1, 1)] = 0.0
    sampled_index = torch.multinomial(probs_sort, num_samples=1)
    ids = torch.gather(probs_idx, dim=1, index=sampled_index).view(-1)
    return ids, probs_sort, probs_idx.to(torch.int32), torch.gather(probs_sort, 1, sampled_index).view(-1)


@lru_cache(maxsize=None)
def _sglang_filter() -> Callable:
    if SGLANG is None:
        return _transcribed_filter
    return _function_from_source(
        "srt/layers/sampler.py", "top_k_top_p_min_p_sampling_from_probs_torch",
        {"torch": torch, "Optional": Optional},
    )


def _sglang_normalize() -> Callable:
    """The temperature/top_k special cases of SamplingParams.__post_init__, as a function of self."""
    if SGLANG is None:
        pytest.skip("sglang wheel not installed")
    tree = _module_ast("srt/sampling/sampling_params.py")
    consts = {}
    for n in tree.body:  # _SAMPLING_EPS, TOP_K_ALL
        if isinstance(n, ast.Assign) and n.targets[0].id in ("_SAMPLING_EPS", "TOP_K_ALL"):
            consts[n.targets[0].id] = eval(compile(ast.Expression(n.value), "c", "eval"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    post = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__post_init__")
    ifs = [s for s in post.body if isinstance(s, ast.If)
           and any(k in ast.unparse(s.test) for k in ("temperature", "top_k"))]
    assert ifs, "SGLang moved its greedy normalisation; re-read sampling_params.py"
    fn = ast.FunctionDef(name="normalize", args=ast.arguments(
        posonlyargs=[], args=[ast.arg("self")], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=ifs, decorator_list=[], returns=None, type_params=[])
    ns = dict(consts)
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), "n", "exec"), ns)
    return ns["normalize"], consts


def _sglang_is_all_greedy_expr() -> ast.expr:
    tree = _module_ast("srt/sampling/sampling_batch_info.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "is_all_greedy":
            return node.value
    raise AssertionError("is_all_greedy not found in sampling_batch_info.py")


def _sglang_dist(logits, temperature, top_p, top_k, min_p) -> torch.Tensor:
    """What Sampler.forward + the pytorch backend sample from, for non-greedy rows."""
    fn = _sglang_filter()
    top_ks = torch.where(top_k == -1, torch.full_like(top_k, TOP_K_ALL), top_k).to(torch.int32)
    logits = logits.clone()
    logits.div_(temperature.view(-1, 1))  # Sampler.forward
    probs = torch.softmax(logits, dim=-1)  # sampler_softmax == torch.softmax on CPU
    out = torch.empty_like(probs)
    for i in range(probs.shape[0]):  # one request per batch: no cross-row mask sharing
        simple = top_p[i] == 1.0 and top_ks[i] == TOP_K_ALL and min_p[i] == 0
        if simple:  # Sampler._sample_from_probs: simple_sampling_case, no filter at all
            out[i] = probs[i]
            continue
        _, kept, idx, _ = fn(probs[i:i + 1].clone(), top_ks[i:i + 1], top_p[i:i + 1], min_p[i:i + 1],
                             bool(min_p[i] > 0), None, None, return_filtered_probs=True)
        row = torch.zeros_like(probs[i]).scatter_(-1, idx[0].long(), kept[0])
        out[i] = row / row.sum()
    return out


# ----------------------------------------------------------------------------- fixtures
def _random_params(n: int, v: int, g: torch.Generator):
    logits = torch.randn(n, v, generator=g) * 3
    temperature = 0.1 + 1.9 * torch.rand(n, generator=g)
    top_p = torch.where(torch.rand(n, generator=g) < 0.3, torch.ones(n), torch.rand(n, generator=g))
    top_p = top_p.clamp_min(0.01)
    top_k = torch.randint(2, v + 3, (n,), generator=g)
    top_k = torch.where(torch.rand(n, generator=g) < 0.3, torch.full_like(top_k, -1), top_k)
    min_p = torch.where(torch.rand(n, generator=g) < 0.5, torch.zeros(n), 0.3 * torch.rand(n, generator=g))
    return logits, temperature, top_p, top_k, min_p


# ----------------------------------------------------------------------------- parity with SGLang
def test_matches_sglang_pytorch_backend():
    g = torch.Generator().manual_seed(0)
    logits, temperature, top_p, top_k, min_p = _random_params(256, 40, g)
    ours = target_probs(logits, temperature, top_p, top_k, min_p)
    ref = _sglang_dist(logits, temperature, top_p, top_k, min_p)
    assert torch.equal(ours > 0, ref > 0)  # identical support
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    # SGLang's own [N, 1] temperature layout works too
    torch.testing.assert_close(target_probs(logits, temperature.view(-1, 1), top_p, top_k, min_p), ours)


def test_matches_sglang_with_ties_and_boundary_top_p():
    # Tied probabilities around the top-k boundary, and a top_p hit exactly by the cumsum.
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.125, 0.125],
                                     [0.5, 0.25, 0.125, 0.0625, 0.0625],
                                     [0.2, 0.2, 0.2, 0.2, 0.2]]))
    temperature = torch.ones(3)
    top_p = torch.tensor([1.0, 0.75, 0.4])
    top_k = torch.tensor([2, -1, 3])
    min_p = torch.zeros(3)
    ours = target_probs(logits, temperature, top_p, top_k, min_p)
    ref = _sglang_dist(logits, temperature, top_p, top_k, min_p)
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref)
    # mass before rank 2 is exactly 0.75 == top_p: SGLang's ">" keeps rank 2 as well
    assert (ours[1] > 0).sum() == 3


def test_transcription_matches_installed_source():
    if SGLANG is None:
        pytest.skip("sglang wheel not installed")
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(8, 30, generator=g), -1)
    args = (torch.randint(1, 30, (8,), generator=g).int(), torch.rand(8, generator=g),
            0.2 * torch.rand(8, generator=g), True, None, None)
    a = _sglang_filter()(probs.clone(), *args, return_filtered_probs=True)
    b = _transcribed_filter(probs.clone(), *args, return_filtered_probs=True)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


# ----------------------------------------------------------------------------- greedy
def test_greedy_criterion_matches_sglang():
    normalize, consts = _sglang_normalize()
    assert consts["_SAMPLING_EPS"] == SAMPLING_EPS and consts["TOP_K_ALL"] == TOP_K_ALL
    expr = compile(ast.Expression(_sglang_is_all_greedy_expr()), "g", "eval")
    for t in (0.0, 1e-7, 9.99e-7, 1e-6, 0.5, 1.0, 2.0):
        for k in (-1, 1, 2, 5, TOP_K_ALL):
            sp = types.SimpleNamespace(temperature=t, top_k=k)
            normalize(sp)
            req = types.SimpleNamespace(sampling_params=sp)
            sglang_greedy = eval(expr, {"reqs": [req]})
            ours_raw = is_greedy(torch.tensor([t]), torch.tensor([k]))
            ours_norm = is_greedy(torch.tensor([sp.temperature]), torch.tensor([sp.top_k]))
            assert bool(ours_raw) == sglang_greedy == bool(ours_norm), (t, k)


def test_greedy_rows_one_hot_at_torch_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 1.0, 2.0, 5.0], [2.0, 2.0, 1.0, 0.0]])
    out = target_probs(logits, torch.tensor([0.0, 0.7, 0.5]), torch.tensor([1.0, 0.9, 1.0]),
                       torch.tensor([-1, 1, -1]), torch.zeros(3))
    assert torch.equal(out[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # tie -> first index
    assert torch.equal(out[1], torch.tensor([0.0, 0.0, 0.0, 1.0]))  # top_k == 1
    torch.testing.assert_close(out[2], torch.softmax(logits[2] / 0.5, -1))


def test_filter_orders():
    probs = torch.tensor([[0.4, 0.3, 0.3]])
    k, p, m = torch.tensor([2]), torch.tensor([0.5]), torch.zeros(1)
    joint = filter_probs(probs, k, p, m, "joint")  # top-p on the original mass: 0.4 < 0.5 -> keep 2
    seq = filter_probs(probs, k, p, m, "sequential")  # renormalised 4/7 > 0.5 -> keep 1
    torch.testing.assert_close(joint, torch.tensor([[4 / 7, 3 / 7, 0.0]]))
    torch.testing.assert_close(seq, torch.tensor([[1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):
        filter_probs(probs, k, p, m, "bogus")  # type: ignore[arg-type]


@pytest.mark.parametrize("backend,min_p,order", [
    ("flashinfer", True, "sequential"), ("flashinfer", False, "joint"),    # GPU default
    ("intel_xpu", True, "sequential"), ("intel_xpu", False, "joint"),
    ("pytorch", True, "joint"), ("pytorch", False, "joint"),               # CPU default
])
def test_filter_order_follows_the_running_sampler(backend, min_p, order):
    assert sampler_filter_order(backend, min_p) == order


def test_unsupported_sampling_backend_is_refused():
    with pytest.raises(ValueError, match="--sampling-backend 'ascend' is not supported"):
        sampler_filter_order("ascend", False)


def test_filter_order_table_matches_installed_sampler():
    """The table above, read off SGLang's Sampler._sample_from_probs: flashinfer / intel_xpu run
    top_k_renorm -> top_p_renorm -> min_p when need_min_p_sampling, else the fused joint kernel;
    pytorch runs the joint torch function (transcribed and compared above)."""
    if SGLANG is None:
        pytest.skip("sglang wheel not installed")
    src = (SGLANG / "srt/layers/sampler.py").read_text()
    body = src[src.index("def _sample_from_probs"):]
    body = body[: body.index("\n    def ", 1)]
    fi = body.index('if backend in ("flashinfer", "intel_xpu"):')
    pt = body.index('elif backend == "pytorch":')
    branch = body[fi:pt]
    seq = branch[branch.index("if sampling_info.need_min_p_sampling:"):branch.index("else:")]
    calls = [seq.index(c) for c in ("top_k_renorm_prob(", "top_p_renorm_prob(", "min_p_sampling_from_probs(")]
    assert calls == sorted(calls)
    assert 'filter_apply_order="joint"' in branch[branch.index("else:"):]
    assert "top_k_top_p_min_p_sampling_from_probs_torch(" in body[pt:]
    assert 'raise ValueError(f"Invalid sampling backend' in body[pt:]  # no other backend samples here


# ----------------------------------------------------------------------------- properties
seeds = st.integers(0, 2**31 - 1)
vocab = st.integers(2, 40)


@settings(max_examples=40, deadline=None)
@given(seed=seeds, v=vocab, order=st.sampled_from(["joint", "sequential"]))
def test_rows_are_distributions_over_a_top_set(seed, v, order):
    g = torch.Generator().manual_seed(seed)
    logits, temperature, top_p, top_k, min_p = _random_params(16, v, g)
    temperature[::5] = 0.0  # some greedy rows
    out = target_probs(logits, temperature, top_p, top_k, min_p, filter_order=order)
    assert (out >= 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(16))
    assert ((out > 0).sum(-1) >= 1).all()
    assert ((out > 0).sum(-1) <= effective_top_k(top_k, v)).all()
    # kept tokens are a top set of the tempered softmax: min kept prob >= max dropped prob
    base = torch.softmax(logits / torch.where(temperature > 0, temperature, 1.0).view(-1, 1), -1)
    kept_min = torch.where(out > 0, base, torch.inf).min(-1).values
    dropped_max = torch.where(out > 0, -torch.inf, base).max(-1).values
    assert (kept_min >= dropped_max).all()


@settings(max_examples=40, deadline=None)
@given(seed=seeds, v=vocab, order=st.sampled_from(["joint", "sequential"]))
def test_support_shrinks_monotonically(seed, v, order):
    g = torch.Generator().manual_seed(seed)
    logits, temperature, top_p, top_k, min_p = _random_params(16, v, g)

    def support(tp, tk, mp):
        return target_probs(logits, temperature, tp, tk, mp, filter_order=order) > 0

    s = support(top_p, top_k, min_p)
    smaller_p = support(top_p * torch.rand(16, generator=g).clamp_min(0.05), top_k, min_p)
    k = effective_top_k(top_k, v)
    smaller_k = support(top_p, torch.maximum(k - torch.randint(0, v, (16,), generator=g), torch.ones_like(k)), min_p)
    larger_m = support(top_p, top_k, min_p + (1 - min_p) * torch.rand(16, generator=g))
    for smaller in (smaller_p, smaller_k, larger_m):
        assert not (smaller & ~s).any()  # subset


@settings(max_examples=40, deadline=None)
@given(seed=seeds, v=vocab)
def test_no_filter_is_tempered_softmax_and_greedy_flags(seed, v):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, v, generator=g) * 4
    t = torch.rand(8, generator=g) * 2
    t[0], t[1] = 0.0, 5e-7  # both below SGLang's 1e-6
    top_k = torch.full((8,), -1)
    top_k[2] = 1
    out = target_probs(logits, t, torch.ones(8), top_k, torch.zeros(8))
    greedy = is_greedy(t, top_k)
    assert greedy[:3].all() and bool(greedy[3:].eq(t[3:] < SAMPLING_EPS).all())
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), v).float()
    torch.testing.assert_close(out[greedy], one_hot[greedy])
    ref = torch.softmax(logits / t.view(-1, 1), -1)
    torch.testing.assert_close(out[~greedy], ref[~greedy])
