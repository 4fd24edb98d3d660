#!/usr/bin/env python
"""Bounded load test of the saguaro server (issue 7): SGLang's serving benchmark, mixed lengths and
temperatures, zero errors, zero T = 0 mismatches against a plain server, bounded draft memory.

1. A plain SGLang server (AR) answers the T = 0 half of the load: the reference texts.
2. A saguaro server (SSD, async) gets, per wave, two concurrent ``sglang.benchmark.serving`` clients:
   T = 0 (the same requests as the reference, same seed and order) and T = 1.0 with top_p 0.95, each at
   max concurrency --concurrency / 2, so the server sees --concurrency requests at once. Output lengths
   are mixed (the dataset's answer turn sets each request's length: 8 to 64 tokens, EOS ignored).
3. Between and after waves: the draft's RSS (psutil, by the pid its health reports) and its live state
   (live requests, KV bytes, cache entries) must return to their idle values: no per-request leak.
Writes results/load_test.{json,md}. Not a CI test (about 20 minutes on the 2-core CPU machine).

    python scripts/load_test.py [--requests 100] [--waves 2] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_serving_cpu import client_env  # noqa: E402
from bench_verify import cpu_name  # noqa: E402
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.client import DraftClient  # noqa: E402
from sglang_ssd.serving import SGLangServer  # noqa: E402

log = logging.getLogger("load_test")
OUT = HERE.parent / "results" / "load_test"
LENGTHS = (8, 16, 32, 48, 64)
LEAK_MB = 64  # allowed draft RSS growth between the first and the last wave


def write_dataset(path: Path, tokenizer) -> None:
    """prompts_bench.json as 'custom' JSONL; the answer turn is LENGTHS[i % 5] tokens long (it sets the
    request's output length when --sharegpt-output-len is not given)."""
    items = json.loads((HERE / "prompts_bench.json").read_text())["prompts"]
    with open(path, "w") as fh:
        for rep in range(4):
            for i, p in enumerate(items):
                text = p["text"]
                if p["kind"] == "chat":
                    text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True, tokenize=False)
                n = LENGTHS[(i + rep) % len(LENGTHS)]
                answer = tokenizer.decode([tokenizer.encode(" a")[-1]] * n)
                fh.write(json.dumps({"conversations": [{"role": "user", "content": text},
                                                       {"role": "assistant", "content": answer}]}) + "\n")


def serving_bench(url: str, dataset: Path, n: int, concurrency: int, body: dict, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url,
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--tokenizer", paths.target_path(),
           "--num-prompts", str(n), "--request-rate", "inf", "--max-concurrency", str(concurrency),
           "--seed", str(seed), "--output-file", str(out), "--output-details", "--disable-tqdm",
           "--extra-request-body", json.dumps(body)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=client_env(out.parent))
    return json.loads(out.read_text().strip().splitlines()[-1])


class MemoryWatch(threading.Thread):
    """Samples a process's RSS every `every` seconds until stopped."""

    def __init__(self, pid: int, every: float = 1.0):
        super().__init__(daemon=True)
        self.proc, self.every, self.samples, self._stop_evt = psutil.Process(pid), every, [], threading.Event()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            try:
                self.samples.append(self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._stop_evt.wait(self.every)

    def stop(self) -> list[int]:
        self._stop_evt.set()
        self.join()
        return self.samples


def to_md(res: dict) -> str:
    n, w_ = res["requests_per_wave"] // 2, res["worker_stats"]
    L = ["# Load test of the saguaro server (issue 7)", "",
         f"SGLang serving benchmark (sglang.benchmark.serving), CPU ({res.get('cpu', '?')}), SSD K = "
         f"{res['worker_stats'].get('k', res.get('k'))} fan-out 4; per wave "
         f"{2 * n} requests: {n} at T = 0 and {n} at T = 1.0 / top_p 0.95 from "
         f"two concurrent clients, total concurrency {res['concurrency']}, output lengths 8-64 tokens "
         f"(scripts/load_test.py). Draft RSS idle {res['draft_rss_idle_mb']:.0f} MB.", "",
         "| wave | completed | errors | T=0 mismatches vs plain SGLang | output tok/s | draft RSS peak / after MB | "
         "live requests / KV bytes / cache entries after |", "|---|---|---|---|---|---|---|"]
    L += [f"| {w['wave']} | {w['completed']} | {w['errors']} | {w['t0_mismatches']} | {w['output_tok_s']} | "
          f"{w['draft_rss_peak_mb']} / {w['draft_rss_after_mb']} | {w['live_requests_after']} / "
          f"{w['kv_bytes_after']} / {w['cache_entries_after']} |" for w in res["waves_detail"]]
    L += ["", f"Draft RSS growth from the first to the last wave: {res['draft_rss_growth_after_first_wave_mb']} MB "
          f"(bound {LEAK_MB} MB).", "", f"Passed: {res['passed']} (zero errors, zero T = 0 mismatches, no live "
          f"requests, KV or cache entries left in the draft after each wave, bounded RSS)"]
    ref = res["reference"]
    L += ["", f"Reference (plain SGLang, the T = 0 requests): {ref['completed']} completed, "
          f"{ref['output_throughput']:.2f} output tok/s. Worker counters at the end (last stats snapshot): "
          f"{w_.get('rows')} rows in {w_.get('rounds')} rounds, hit rate {w_.get('hit_rate', 0):.3f}, accept length "
          f"{w_.get('accept_len', 0):.3f}, errors {w_.get('errors')}, deadline misses {w_.get('deadline_misses')}, "
          f"fallback rows {w_.get('fallback_rows')}, reconnects {w_.get('reconnects')}."]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="per client per wave (two clients: T = 0 and T = 1)")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--k", type=int, default=0, help="drafts per round (0: the plugin measures and chooses)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="load-test-"))
    dataset = work / "load.jsonl"
    write_dataset(dataset, AutoTokenizer.from_pretrained(paths.target_path()))
    half = args.concurrency // 2
    greedy, sampled = {"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.95}
    common = ["--dtype", "float32", "--max-running-requests", str(args.concurrency)]
    with SGLangServer(paths.target_path(), common, cpu_core=0, log_path=str(work / "ar.log")) as srv:
        ref = serving_bench(srv.url, dataset, args.requests, half, greedy, 1, work / "ref.jsonl")
    endpoint = f"ipc://{work}/draft.sock"
    cfg = {"mode": "async", "fan_out": 4, "draft_endpoint": endpoint, "stats_file": str(work / "stats.json")}
    res = {"cpu": cpu_name(), "k": args.k or "auto",
           "requests_per_wave": 2 * args.requests, "waves": args.waves, "concurrency": args.concurrency,
           "reference": {k: ref[k] for k in ("completed", "output_throughput")}, "waves_detail": []}
    with SGLangServer(paths.target_path(), common + ["--speculative-algorithm", "saguaro",
                                                     "--speculative-draft-model-path", paths.draft_path()]
                      + (["--speculative-num-steps", str(args.k)] if args.k else []),
                      env={"SGLANG_SSD_CONFIG": json.dumps(cfg)}, cpu_core=0,
                      log_path=str(work / "saguaro.log")) as srv:
        with DraftClient(endpoint, timeout_s=30) as client:
            idle = client.health()
        res["draft_rss_idle_mb"] = psutil.Process(int(idle["pid"])).memory_info().rss / 2**20
        for wave in range(args.waves):
            watch = MemoryWatch(int(idle["pid"]))
            watch.start()
            outs = {}
            threads = [threading.Thread(target=lambda name, body, seed: outs.__setitem__(name, serving_bench(
                srv.url, dataset, args.requests, half, body, seed, work / f"{name}-{wave}.jsonl")),
                args=a) for a in (("greedy", greedy, 1), ("sampled", sampled, 2))]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            rss = watch.stop()
            time.sleep(1.0)
            with DraftClient(endpoint, timeout_s=30) as client:
                h = client.health()
            g, s = outs["greedy"], outs["sampled"]
            mismatches = sum(a != b for a, b in zip(g["generated_texts"], ref["generated_texts"])) + abs(
                len(g["generated_texts"]) - len(ref["generated_texts"]))
            errors = sum(bool(e) for e in g["errors"] + s["errors"])
            detail = {"wave": wave, "seconds": round(wall, 1), "completed": g["completed"] + s["completed"],
                      "errors": errors, "t0_mismatches": mismatches,
                      "output_tok_s": round((sum(g["output_lens"]) + sum(s["output_lens"])) / wall, 2),
                      "accept_length_t0": g.get("accept_length"), "accept_length_t1": s.get("accept_length"),
                      "draft_rss_peak_mb": round(max(rss) / 2**20, 1),
                      "draft_rss_after_mb": round(psutil.Process(int(idle["pid"])).memory_info().rss / 2**20, 1),
                      "live_requests_after": h["live_requests"], "kv_bytes_after": h["kv_bytes"],
                      "cache_entries_after": h["cache_entries"]}
            res["waves_detail"].append(detail)
            log.info("wave %d: %s", wave, detail)
        res["worker_stats"] = json.loads((work / "stats.json").read_text())
    waves = res["waves_detail"]
    # no per-request leak: after the first wave (allocator and caches warmed up) the draft's RSS after each
    # further wave stays within LEAK_MB of the first wave's, although every wave adds 2 x --requests requests
    growth = waves[-1]["draft_rss_after_mb"] - waves[0]["draft_rss_after_mb"]
    res["draft_rss_growth_after_first_wave_mb"] = round(growth, 1)
    ok = all(w["errors"] == 0 and w["t0_mismatches"] == 0 and w["live_requests_after"] == 0
             and w["kv_bytes_after"] == 0 and w["cache_entries_after"] == 0 for w in waves) \
        and res["draft_rss_growth_after_first_wave_mb"] < LEAK_MB
    res["passed"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    md = to_md(res)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
