"""Long prompts (1k-4k tokens) through the real scheduler: saguaro's linear-cost CPU chain verify
(sglang_ssd/cpu/chain_attention.py) must keep greedy output token-identical to plain SGLang, with
requests of very different lengths verified in one batch (the length-grouped SDPA path)."""

import concurrent.futures as cf
import json
import uuid
from pathlib import Path

import pytest

from sglang_ssd.serving import SGLangServer

pytestmark = pytest.mark.server
CONTEXT = 4608
LENGTHS = (1000, 2100, 4200)
NEW_TOKENS = 24
COMMON = ["--dtype", "float32", "--max-running-requests", "4", "--random-seed", "1", "--context-length", str(CONTEXT)]


def _long_prompts(tokenizer) -> list[list[int]]:
    """Real text (this project's README and notes-like sources), cut to each target length."""
    root = Path(__file__).resolve().parents[1]
    text = "\n\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "sglang_ssd").rglob("*.py"))])
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > max(LENGTHS), len(ids)
    return [ids[i * 97 : i * 97 + n] for i, n in enumerate(LENGTHS)]


def _generate_all(srv, prompts):
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(srv.generate, input_ids=ids, sampling_params=sp) for ids in prompts]
        return [f.result()["output_ids"] for f in futs]


def test_long_prompts_greedy_equal_plain_sglang(target_path, draft_path, tmp_path):
    from transformers import AutoTokenizer

    prompts = _long_prompts(AutoTokenizer.from_pretrained(target_path))
    with SGLangServer(target_path, COMMON, cpu_core=0, log_path=str(tmp_path / "ar.log")) as srv:
        want = _generate_all(srv, prompts)
    stats = tmp_path / "stats.json"
    env = {"SGLANG_SSD_CONFIG": json.dumps({
        "mode": "async", "fan_out": 2, "stats_file": str(stats), "stats_interval": 10, "round_deadline_s": 10,
        "draft_endpoint": f"ipc://{tmp_path}/draft-{uuid.uuid4().hex[:6]}.sock"})}
    args = COMMON + ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", draft_path,
                     "--speculative-num-steps", "3"]
    with SGLangServer(target_path, args, env=env, cpu_core=0, log_path=str(tmp_path / "ssd.log")) as srv:
        got = _generate_all(srv, prompts)
    for n, g, w in zip(LENGTHS, got, want):
        assert g == w, f"{n}-token prompt: saguaro {g} != plain {w}"
    s = json.loads(stats.read_text())
    assert s["rounds"] > 0 and s["accept_len"] > 1.0 and s["fallback_rows"] == 0, s
