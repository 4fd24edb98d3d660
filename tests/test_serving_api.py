"""What an SGLang user keeps when turning saguaro on (issue 17), against a plain server on the same CPU:
grammar-constrained output (json_schema, regex, ebnf, structural tags; mixed with unconstrained
requests), SGLang's own error for an invalid grammar, the OpenAI-compatible API (streaming and not,
chat and completions, n > 1, logprobs, stop sequences, max_tokens edge cases, usage counts), SGLang
frontend programs (examples/frontend_program.py: sgl.function with gen, a multi-turn chat through the chat
template) run unchanged, and saguaro's Prometheus series on /metrics next to SGLang's.  Greedy, so every
text must be identical.  (One plain and one saguaro server for all of it: a CPU server start costs ~80 s.)"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import sys
import uuid
from pathlib import Path

import pytest
import requests

from sglang_ssd.serving import SGLangServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from frontend_program import run_programs  # noqa: E402

pytestmark = pytest.mark.server
COMMON = ["--dtype", "float32", "--max-running-requests", "8", "--random-seed", "1", "--context-length", "1024",
          "--enable-metrics"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
STRUCTURAL_TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<answer>"], "tags": [
    {"begin": "<answer>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</answer>"}]}}
PROMPT = "Here is a person described as JSON with a name and an age:"


def _generate(url, text, sp):
    r = requests.post(url + "/generate", json={"text": text, "sampling_params": sp}, timeout=300)
    return r.status_code, (r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text)


def _constrained(url):
    """Constrained and unconstrained requests at once, so batches mix them."""
    g = {"temperature": 0, "max_new_tokens": 64}
    jobs = {
        "json_schema": (PROMPT, {**g, "json_schema": json.dumps(SCHEMA)}),
        "regex": ("My phone number is", {**g, "regex": r"\(\d{3}\) \d{3}-\d{4}"}),
        "ebnf": ("Is the sky blue? Answer:", {**g, "ebnf": 'root ::= " yes" | " no" | " maybe, " [a-z]+ "."'}),
        "structural_tag": ("Reply with <answer> and a JSON person.", {**g, "structural_tag": json.dumps(STRUCTURAL_TAG)}),
        "free1": ("Tell me about the moon.", {**g, "max_new_tokens": 48, "ignore_eos": True}),
        "free2": ("Write a haiku about rain.", {**g, "max_new_tokens": 40, "ignore_eos": True}),
    }
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futs = {k: pool.submit(_generate, url, *v) for k, v in jobs.items()}
        out = {k: f.result() for k, f in futs.items()}
    res = {k: (code, body["text"], body["meta_info"]["finish_reason"], body["meta_info"]["completion_tokens"])
           if code == 200 else (code, body) for k, (code, body) in out.items()}
    for key, sp in (("invalid_regex", {"regex": "(unclosed"}), ("invalid_schema", {"json_schema": "{not json"})):
        code, body = _generate(url, "Hi", {**g, **sp})
        res[key] = (code, re.sub(r"\[\d\d:\d\d:\d\d\] ", "", json.dumps(body)))  # xgrammar stamps the time
    return res


def _sse(resp):
    chunks = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks


def _openai(url):
    out = {}
    comp = {"model": "default", "prompt": "The three primary colors are", "temperature": 0, "max_tokens": 32}
    for name, extra in {"plain": {}, "stop": {"stop": [".", "\n\n"]}, "n2": {"n": 2},
                        "logprobs": {"logprobs": 2}, "max1": {"max_tokens": 1},
                        "long": {"max_tokens": 200, "ignore_eos": False}}.items():
        r = requests.post(url + "/v1/completions", json={**comp, **extra}, timeout=300)
        r.raise_for_status()
        j = r.json()
        out[f"completions_{name}"] = {"choices": [(c["text"], c["finish_reason"], c.get("logprobs")) for c in j["choices"]],
                                      "usage": (j["usage"]["prompt_tokens"], j["usage"]["completion_tokens"])}
    r = requests.post(url + "/v1/completions", json={**comp, "stream": True, "stream_options": {"include_usage": True}},
                      stream=True, timeout=300)
    chunks = _sse(r)
    out["completions_stream"] = ("".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
                                 [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1],
                                 [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks if c.get("usage")][-1])
    chat = {"model": "default", "messages": [{"role": "user", "content": "Name two planets."}], "temperature": 0,
            "max_tokens": 40}
    for name, extra in {"plain": {}, "n2": {"n": 2}, "logprobs": {"logprobs": True, "top_logprobs": 2},
                        "stop": {"stop": [","]},
                        "json": {"response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "person", "schema": SCHEMA}},
                                 "messages": [{"role": "user", "content": "Give me a person as JSON."}]}}.items():
        r = requests.post(url + "/v1/chat/completions", json={**chat, **extra}, timeout=300)
        r.raise_for_status()
        j = r.json()
        out[f"chat_{name}"] = {"choices": [(c["message"]["content"], c["finish_reason"], c.get("logprobs")) for c in j["choices"]],
                               "usage": (j["usage"]["prompt_tokens"], j["usage"]["completion_tokens"])}
    r = requests.post(url + "/v1/chat/completions", json={**chat, "stream": True,
                                                          "stream_options": {"include_usage": True}},
                      stream=True, timeout=300)
    chunks = _sse(r)
    out["chat_stream"] = ("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]),
                          [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1],
                          [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks if c.get("usage")][-1])
    bad = requests.post(url + "/v1/completions", json={**comp, "max_tokens": 5000}, timeout=60)
    out["max_tokens_over_context"] = (bad.status_code, bad.json().get("message", bad.text)[:200] if bad.text else "")
    return out


def _run_all(srv):
    return {"constrained": _constrained(srv.url), "openai": _openai(srv.url), "frontend": run_programs(srv.url),
            "metrics": requests.get(srv.url + "/metrics", timeout=60).text}


@pytest.fixture(scope="module")
def results(target_path, draft_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving_api")
    with SGLangServer(target_path, COMMON, cpu_core=0, log_path=str(tmp / "plain.log")) as srv:
        plain = _run_all(srv)
    # a generous round deadline: this test checks what users keep, not the draft's speed on a loaded CI machine
    cfg = {"mode": "async", "fan_out": 2, "round_deadline_s": 10.0,
           "draft_endpoint": f"ipc://{tmp}/draft-{uuid.uuid4().hex[:6]}.sock"}
    with SGLangServer(target_path, COMMON + ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path",
                                             draft_path, "--speculative-num-steps", "3"],
                      env={"SGLANG_SSD_CONFIG": json.dumps(cfg)}, cpu_core=0, log_path=str(tmp / "saguaro.log")) as srv:
        spec = _run_all(srv)
        spec["metrics_after"] = requests.get(srv.url + "/metrics", timeout=60).text
    return plain, spec


def test_frontend_program_same_as_plain(results):
    """The frontend programs know nothing of speculation: same variables, same chat text."""
    plain, spec = results
    f = plain["frontend"]
    assert all(f[k].strip() for k in ("tip1", "tip2", "answer1", "answer2")), f  # every slot generated
    assert f["chat_text"].count("<|im_start|>assistant") == 2  # the chat went through the chat template
    assert spec["frontend"] == f


def _close_logprobs(a, b, tol=2e-3):
    """Same tokens; log-probabilities equal up to the verify forward's float rounding."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close_logprobs(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close_logprobs(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    return a == b


def test_structured_output_same_as_plain(results):
    plain, spec = results
    for key in ("json_schema", "regex", "ebnf", "structural_tag", "free1", "free2"):
        assert spec["constrained"][key] == plain["constrained"][key], key
    code, text, finish, _ = spec["constrained"]["json_schema"]
    person = json.loads(text)  # valid JSON of the schema's shape
    assert code == 200 and set(person) == {"name", "age"} and isinstance(person["age"], int), text
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", spec["constrained"]["regex"][1])
    assert spec["constrained"]["ebnf"][1] in (" yes", " no") or spec["constrained"]["ebnf"][1].startswith(" maybe, ")


def test_invalid_grammar_gets_sglangs_error(results):
    plain, spec = results
    for key in ("invalid_regex", "invalid_schema"):
        assert spec["constrained"][key] == plain["constrained"][key], key
        assert spec["constrained"][key][0] == 400, spec["constrained"][key]


def test_openai_api_same_as_plain(results):
    plain, spec = results
    for key, ref in plain["openai"].items():
        got = spec["openai"][key]
        if key in ("completions_logprobs", "chat_logprobs"):
            assert got["usage"] == ref["usage"]
            assert [c[:2] for c in got["choices"]] == [c[:2] for c in ref["choices"]], key
            assert _close_logprobs([c[2] for c in got["choices"]], [c[2] for c in ref["choices"]]), key
            assert all(c[2] for c in got["choices"]), key
        else:
            assert got == ref, key
    o = spec["openai"]
    assert len(o["completions_n2"]["choices"]) == 2 and len(o["chat_n2"]["choices"]) == 2
    assert o["completions_max1"]["usage"][1] == 1 and o["completions_max1"]["choices"][0][1] == "length"
    assert o["completions_stream"][0] == o["completions_plain"]["choices"][0][0]
    assert o["chat_stream"][:2] == o["chat_plain"]["choices"][0][:2]
    assert o["completions_stop"]["choices"][0][1] == "stop"
    json.loads(o["chat_json"]["choices"][0][0])
    assert o["max_tokens_over_context"][0] == 400


def _samples(text: str, name: str) -> dict[str, float]:
    """{label-string: value} of one metric family in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+|NaN)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def test_metrics_carry_saguaro_series(results):
    plain, spec = results
    text = spec["metrics_after"]
    rounds = _samples(text, "sglang:saguaro_rounds_total")
    assert rounds and all('model_name="' in k and 'tp_rank="0"' in k for k in rounds), rounds
    assert sum(rounds.values()) > 10
    assert sum(_samples(text, "sglang:saguaro_rows_total").values()) >= sum(rounds.values())
    assert sum(_samples(text, "sglang:saguaro_cache_hits_total").values()) > 0
    assert 0 < sum(_samples(text, "sglang:saguaro_cache_hit_rate").values()) <= 1
    for h in ("draft_wait_seconds", "verify_seconds", "accept_seconds", "cache_build_seconds"):
        assert sum(_samples(text, f"sglang:saguaro_{h}_count").values()) > 0, h
        assert sum(_samples(text, f"sglang:saguaro_{h}_sum").values()) > 0, h
    backup = _samples(text, "sglang:saguaro_backup_rows_total")
    assert {'kind="neural"', 'kind="fast"'} <= {re.search(r'kind="\w+"', k).group(0) for k in backup}
    assert sum(backup.values()) > 0
    for c in ("fallback_rows_total", "draft_errors_total", "deadline_misses_total"):
        assert _samples(text, f"sglang:saguaro_{c}") and sum(_samples(text, f"sglang:saguaro_{c}").values()) == 0, c
    assert _samples(text, "sglang:saguaro_reconnects_total")
    assert _samples(text, "sglang:spec_accept_length"), "SGLang's own speculative series"
    # the plain server has SGLang's series and none of ours
    assert _samples(plain["metrics"], "sglang:num_running_reqs") and "saguaro" not in plain["metrics"]
