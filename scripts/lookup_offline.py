#!/usr/bin/env python
"""Offline accept length of the draft's greedy choices with and without its lookups (issue 15).

Along target-greedy trajectories, the draft's token at each position (teacher-forced on the true prefix) is its
argmax, then the request's own prompt lookup (saguaro/lookup.py's rule over the context's n-gram index), then
the corpus lookup (saguaro/datastore.py) where the first did not act.  A K = 3 chain is simulated in rounds:
a round starts after the previous round's bonus token and commits (accepted prefix + 1) tokens, as the server
does.  (An average over every start position instead reads about 0.1-0.15 higher: a round that starts right after
a rejection starts in a hard stretch.)

Trajectory sets: the 20 held-out prompts (scripts/prompts_heldout.json, the cached reference of train_draft.py),
the 64 bench prompts (scripts/prompts_bench.json, 64 tokens, EOS ignored as in the server), and T = 0 answers of
the third diverse pool (assets/gen jobs 300001/5/9/13, one answer in 40) with those jobs left out of the store.

    python scripts/lookup_offline.py          # writes results/lookup_offline.{json,md}
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from draft_data import data_dir  # noqa: E402
from measure_draft import encode_prompt  # noqa: E402
from train_draft import heldout_reference  # noqa: E402
from trained_draft import GEN_DIR  # noqa: E402

from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.model import load_model  # noqa: E402
from sglang_ssd.saguaro.datastore import MAX_P as CORPUS_MAX_P  # noqa: E402
from sglang_ssd.saguaro.datastore import Datastore  # noqa: E402
from sglang_ssd.saguaro.lookup import LOOKUP_MAX_P, LOOKUP_MIN_N  # noqa: E402
from sglang_ssd.saguaro.ngram import NgramIndex  # noqa: E402

log = logging.getLogger("lookup_offline")
VALID_JOBS = (300001, 300005, 300009, 300013)  # T = 0 jobs of the third diverse pool
K = 3


def answers(jobs=None, skip=(), every: int = 1):
    for f in sorted(GEN_DIR.glob("gen_*.npz")):
        job = int(f.stem.split("_")[1])
        if job in skip or (jobs is not None and job not in jobs):
            continue
        with np.load(f) as z:
            toks, offs, plens = z["tokens"].astype(np.int64), z["offsets"], z["prompt_lens"]
        for s in range(0, len(plens), every):
            yield toks[offs[s]:offs[s + 1]], int(plens[s])


@torch.inference_mode()
def bench_trajectories(n_tokens: int = 64) -> list[tuple[str, list[int], int]]:
    """The target's greedy continuation of each bench prompt, EOS ignored (as the server's benchmark)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(paths.target_path())
    target = AutoModelForCausalLM.from_pretrained(paths.target_path(), dtype=torch.float32).eval()
    out = []
    for item in json.loads((HERE / "prompts_bench.json").read_text())["prompts"]:
        ids = encode_prompt(tok, item)
        o = target(torch.tensor([ids]), use_cache=True)
        gen = []
        for _ in range(n_tokens):
            gen.append(int(o.logits[0, -1].argmax()))
            o = target(torch.tensor([[gen[-1]]]), past_key_values=o.past_key_values, use_cache=True)
        out.append((item["kind"], ids + gen, len(ids)))
    return out


@torch.inference_mode()
def hits(draft, store, kind: str, ids: list[int], plen: int, target: list[int]) -> dict[str, list[bool]]:
    """Per answer position: is the proposal the target's token, for the draft alone / + own / + corpus."""
    z = draft.logits(draft.forward_padded(torch.tensor([ids]))[0, plen - 1: len(ids) - 1])
    top_p, arg = torch.softmax(z.float(), -1).max(-1)
    idx = NgramIndex(4, 1, tokens=ids[:plen])
    res = {"draft": [], "own": [], "corpus": []}
    for t, want in enumerate(target):
        d, p = int(arg[t]), float(top_p[t])
        n, e = idx.match()
        own = idx.tokens[e] if n >= LOOKUP_MIN_N and p < LOOKUP_MAX_P else d
        hit = store.next_token(ids[:plen + t]) if own == d else None
        corpus = hit[1] if hit is not None and p < CORPUS_MAX_P else own
        for k, v in (("draft", d), ("own", own), ("corpus", corpus)):
            res[k].append(v == want)
        idx.append(ids[plen + t])
    return res


def aligned_e(oks: list[list[bool]]) -> float:
    toks = rounds = 0
    for ok in oks:
        t = 0
        while t + K < len(ok):
            a = 0
            while a < K and ok[t + a]:
                a += 1
            toks, rounds, t = toks + a + 1, rounds + 1, t + a + 1
    return toks / max(rounds, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE.parent / "results" / "lookup_offline"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(2)
    t0 = time.time()
    store = Datastore.build(answers(skip=VALID_JOBS))  # the pool answers scored below are left out
    log.info("store: %d continuations (%.1f s)", len(store), time.time() - t0)
    draft = load_model(paths.draft_path())
    ref = heldout_reference(data_dir() / "heldout_ref.pt")
    sets = {"held-out 20 prompts": [(k, ids.tolist(), p, lp.float().argmax(-1).tolist())
                                    for k, (ids, p), lp in zip(ref["kinds"], ref["seqs"], ref["logp"])],
            "64 bench prompts (EOS ignored)": [(k, ids, p, ids[p:]) for k, ids, p in bench_trajectories()],
            "third-pool T = 0 answers (left out of the store)":
                [("pool", a.tolist(), p, a[p:].tolist()) for a, p in answers(VALID_JOBS, every=40) if len(a) - p > K]}
    report = {}
    for name, rows in sets.items():
        per = [(kind, hits(draft, store, kind, ids, p, tgt)) for kind, ids, p, tgt in rows]
        r = {"positions": sum(len(h["draft"]) for _, h in per)}
        for rule in ("draft", "own", "corpus"):
            oks = [h[rule] for _, h in per]
            by_kind = {}
            for kind, h in per:
                by_kind.setdefault(kind, []).extend(h[rule])
            r[rule] = {"alpha": float(np.mean([x for o in oks for x in o])), "E": aligned_e(oks),
                       "alpha_by_kind": {k: round(float(np.mean(v)), 3) for k, v in by_kind.items()}}
        report[name] = r
        log.info("%s: %s", name, {k: (round(v["alpha"], 4), round(v["E"], 3)) for k, v in r.items() if k != "positions"})
    Path(args.out + ".json").write_text(json.dumps({"store": len(store), "k": K, "sets": report}, indent=1) + "\n")
    lines = ["# Offline accept length with the draft's lookups (scripts/lookup_offline.py)", "",
             f"Default draft; K = {K}; rounds start after the previous round's bonus token; store of "
             f"{len(store):,} continuations (the scored pool jobs left out). Greedy alpha / E.", "",
             "| trajectories | positions | draft only | + prompt lookup | + corpus lookup |", "|---|---|---|---|---|"]
    for name, r in report.items():
        lines.append(f"| {name} | {r['positions']:,} | " + " | ".join(
            f"{r[k]['alpha']:.3f} / {r[k]['E']:.3f}" for k in ("draft", "own", "corpus")) + " |")
    lines += ["", "alpha by kind (draft only -> + prompt lookup -> + corpus lookup):", ""]
    for name, r in report.items():
        kinds = r["draft"]["alpha_by_kind"]
        lines.append(f"- {name}: " + ", ".join(
            f"{k} {r['draft']['alpha_by_kind'][k]} -> {r['own']['alpha_by_kind'][k]} -> {r['corpus']['alpha_by_kind'][k]}"
            for k in kinds))
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    log.info("wrote %s.{json,md} (%.0f s)", args.out, time.time() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
