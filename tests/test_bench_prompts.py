"""The benchmark prompt set (scripts/prompts_bench.json) is what issue 6 asks for and is held out from
the draft's distillation prompts, so benchmark acceptance rates are not inflated by training overlap."""

import json
import sys
from collections import Counter
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from prompts_train import train_texts  # noqa: E402

BENCH = json.loads((SCRIPTS / "prompts_bench.json").read_text())["prompts"]


def test_four_kinds_sixteen_each_no_duplicates():
    assert Counter(p["kind"] for p in BENCH) == {"chat": 16, "code": 16, "factual": 16, "math": 16}
    assert len({p["text"] for p in BENCH}) == len(BENCH)


def test_heldout_prompts_lead_each_kind():
    held = json.loads((SCRIPTS / "prompts_heldout.json").read_text())["prompts"]
    for kind in ("chat", "code", "factual", "math"):
        assert [p["text"] for p in BENCH if p["kind"] == kind][:5] == [p["text"] for p in held if p["kind"] == kind]


def test_disjoint_from_distillation_prompts():
    # seed 0 is the seed the committed draft's data was generated with (draft_data.py default)
    train = [t.strip() for t, _ in train_texts(0)]
    for p in BENCH:
        text = p["text"].strip()
        assert not any(text in t or t in text for t in train), p["text"]


def test_bench_cells_use_recorded_prompt_subsets():
    """Every mode sees the same prompts per (T, b, repeat); b = 1 headline cells span the four kinds, and the
    K sweep's 2-prompt subset is half of the K = 3 cell at the same T and repeat (alternating halves)."""
    from bench_cpu import cell_prompts, ordered_prompts, plan

    order = ordered_prompts(BENCH)
    cells = plan({1, 2, 3}, 3)
    head = {(c["temperature"], c["rep"]): cell_prompts(order, c) for c in cells if c["tier"] == 1}
    for c in cells:
        got = cell_prompts(order, c)
        if c["tier"] == 1:
            assert sorted(p["kind"] for p in got) == ["chat", "code", "factual", "math"]
        elif c["tier"] == 3:
            half = 2 * (c["rep"] % 2)
            assert got == head[(c["temperature"], c["rep"])][half:half + 2]
        else:
            assert len(got) == c["batch"] and len({p["text"] for p in got}) == c["batch"]
    for k in (4, 5):  # the K sweep's repeats together cover all four kinds
        kinds = {p["kind"] for c in cells if c["tier"] == 3 and c["k"] == k and c["temperature"] == 0.0
                 for p in cell_prompts(order, c)}
        assert kinds == {"chat", "code", "factual", "math"}


def test_diverse_pool_is_broad_deterministic_and_held_out():
    """The diverse generation pool (draft_data --prompts diverse): the four kinds in about the template pool's
    shares, far more distinct prompts than the template pool, the same list for the same seed, and no prompt
    overlapping a benchmark or held-out prompt."""
    from transformers import AutoTokenizer

    from prompts_diverse import diverse_texts
    from sglang_ssd import paths

    tok = AutoTokenizer.from_pretrained(paths.target_path())
    pool = diverse_texts(tok, 0, n=4000)
    assert pool == diverse_texts(tok, 0, n=4000) and pool != diverse_texts(tok, 1, n=4000)
    texts = [t for t, _ in pool]
    assert len(set(texts)) > 3000 > len({t for t, _ in train_texts(0, n=4000)})
    code = sum(t.startswith(("def ", "class ", "# ")) for t in texts)
    math = sum("Answer:" in t or "Solution:" in t or t.endswith(("is", "equals")) and t[0].isdigit() for t in texts)
    chat = sum(c for _, c in pool)
    assert 0.35 < chat / len(pool) < 0.45 and 0.2 < code / len(pool) < 0.3 and 0.15 < math / len(pool) < 0.25
    for p in BENCH:
        text = p["text"].strip()
        assert not any(text in t or t.strip() in text for t in texts), p["text"]


def test_second_diverse_pool_is_new_distinct_and_held_out():
    """The second diverse pool (draft_data --prompts diverse2): every prompt once, under 3% repeating the first diverse
    pool, all four kinds among its first prompts with chat the largest share, deterministic per seed, and no
    prompt overlapping a benchmark or held-out prompt."""
    from transformers import AutoTokenizer

    from prompts_diverse import diverse2_texts, diverse_texts
    from sglang_ssd import paths

    tok = AutoTokenizer.from_pretrained(paths.target_path())
    pool = diverse2_texts(tok, 0, n=4000)
    assert pool == diverse2_texts(tok, 0, n=4000) and pool != diverse2_texts(tok, 1, n=4000)
    texts = [t for t, _ in pool]
    assert len(set(texts)) == len(texts)
    # a few repeat the first pool's (math forms drawing the same numbers, the template tasks of "How do I {task}?")
    assert len(set(texts) & {t for t, _ in diverse_texts(tok, 0, n=20000)}) < 0.03 * len(texts)
    code = sum("def " in t for t in texts)
    math = sum("Answer:" in t or "Solution:" in t or t.endswith(("is", "equals")) and t[0].isdigit() for t in texts)
    chat = sum(c for _, c in pool)
    fact = len(pool) - code - math - chat
    assert chat / len(pool) > 0.35 and min(code, math, fact) / len(pool) > 0.1, (chat, code, math, fact)
    for p in BENCH:  # the held-out prompts lead each kind of BENCH
        text = p["text"].strip()
        assert not any(text in t or t.strip() in text for t in texts), p["text"]


def test_third_diverse_pool_repeats_no_earlier_pool_and_is_held_out():
    """The third diverse pool (draft_data --prompts diverse3): every prompt once, none from the first two pools,
    chat the largest share with code and factual prompts among the first ones, deterministic per seed, and no
    prompt overlapping a benchmark or held-out prompt."""
    from transformers import AutoTokenizer

    from prompts_diverse import diverse2_texts, diverse3_texts, diverse_texts
    from sglang_ssd import paths

    tok = AutoTokenizer.from_pretrained(paths.target_path())
    pool = diverse3_texts(tok, 0, n=3000)
    assert pool == diverse3_texts(tok, 0, n=3000) and pool != diverse3_texts(tok, 1, n=3000)
    texts = [t for t, _ in pool]
    assert len(set(texts)) == len(texts) == 3000
    assert not set(texts) & ({t for t, _ in diverse_texts(tok, 0)} | {t for t, _ in diverse2_texts(tok, 0)})
    code = sum(t.startswith(("import ", "class ")) and "def " in t for t in texts)
    chat = sum(c for _, c in pool)
    assert chat / len(pool) > 0.45 and code / len(pool) > 0.1, (chat, code)
    assert len(pool) - chat - code > 0.2 * len(pool)  # factual and math
    for p in BENCH:  # the held-out prompts lead each kind of BENCH
        text = p["text"].strip()
        assert not any(text in t or t.strip() in text for t in texts), p["text"]
