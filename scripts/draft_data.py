#!/usr/bin/env python
"""Distillation data for the draft: the target's top-k next-token probabilities, stored once.

Two kinds of jobs, interleaved in a fixed seeded order (so a stopped run resumes where it left off):
  text  teacher-forced scoring of existing text that ships on the machine: Python's bundled docs
        (pydoc_data.topics), standard-library source files, package READMEs (dist-info METADATA) and
        /usr/share/doc text; 4 windows x 256 tokens per job, every position labelled.
  gen   the target's own answers to programmatic prompts of four kinds (chat through the chat template,
        code, math, factual completions; none equal to a held-out prompt), 512 per job (a static-KV
        batched loop, scripts/fast_generate.py), up to 96 new tokens; every prompt is answered
        once per pass, the passes at T = 1, 0.7, 0, 1, 0.7; each generated position labelled with the
        target's T=1 distribution.

Every job writes one shard (safetensors): tokens int32 [N] (all sequences of the job, concatenated),
offsets int64 [S+1], label_pos int64 [M] (index into tokens of each labelled position: the label is the
target's distribution of the token AFTER it), topk_ids int32 [M, k], topk_p float16 [M, k].

Usage:
    taskset -c 1 python scripts/draft_data.py --minutes 60          # resumes; progress bar on stderr
    taskset -c 0 python scripts/draft_data.py --kinds gen --part 0/2 # both cores, generation only:
    taskset -c 1 python scripts/draft_data.py --kinds gen --part 1/2 #   each process takes every other job
    python scripts/draft_data.py --stats                             # what is there
    python scripts/draft_data.py --export-gen assets/gen             # the generated answers, tokens only
    python scripts/draft_data.py --import-gen assets/gen             # ... labelled again by teacher forcing
    python scripts/draft_data.py --import-gen assets/gen --hard      # ... or by their own tokens (seconds)

Machines do not keep the data directory between sessions, and the labels are large (32 x 6 bytes per
position), so the generated answers -- the slow part: sampling runs at ~136 tokens/s per core -- are kept
as tokens only (uint16, 2 bytes per token, assets/gen/) and re-labelled with the target by teacher forcing
(one forward per sequence: the target's T = 1 top-k at each generated position, the same label
generation stored, up to float rounding), which runs several times faster than sampling.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sglang_ssd import paths  # noqa: E402
from fast_generate import StaticBatchGenerator  # noqa: E402
from prompts_diverse import diverse2_texts, diverse3_texts, diverse_texts  # noqa: E402
from prompts_train import encode, train_prompts  # noqa: E402
from sglang_ssd.draft.model import load_model  # noqa: E402

log = logging.getLogger("draft_data")
TOPK = 32
WINDOW = 256
TEXT_BATCH = 4
GEN_BATCH = 512  # prompts per generation job, answered GEN_ROWS at a time (rows refilled as answers end)
GEN_ROWS = 128   # fast_generate's static batch (results/gen_speed.md)
GEN_TOKENS = 96
# temperature of each pass over the prompts (T = 1 twice: two different samples), ~4 x 6k answers in all
GEN_PASSES = (1.0, 0.7, 0.0, 1.0, 0.7)
# job pattern: one generation job (512 prompts, up to 49k positions) per four text jobs (4k positions)
PATTERN = ("gen", "text", "text", "text", "text")
# the diverse pool (--prompts diverse, prompts_diverse.diverse_texts): one pass, the temperature cycling per job,
# job numbers from DIVERSE_JOB0 (its shards and exported answers never collide with the template pool's)
DIVERSE_TEMPS = (1.0, 0.0, 0.7, 1.0)
DIVERSE_JOB0 = 100000
DIVERSE2_JOB0 = 200000  # the second diverse pool (--prompts diverse2, prompts_diverse.diverse2_texts)
DIVERSE3_JOB0 = 300000  # the third (--prompts diverse3, prompts_diverse.diverse3_texts)
DIVERSE_POOLS = {"diverse": (diverse_texts, DIVERSE_JOB0), "diverse2": (diverse2_texts, DIVERSE2_JOB0),
                 "diverse3": (diverse3_texts, DIVERSE3_JOB0)}
GEN_ASSETS = HERE.parent / "assets" / "gen"  # answers already committed as tokens only (export_gen)


def data_dir() -> Path:
    return Path(os.environ.get("SGLANG_SSD_TRAIN_DIR", os.path.join(paths.models_dir(), "..", "train"))).resolve()


# ----------------------------------------------------------------------------------------------- text sources
def _read(path: str) -> str:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt", errors="replace") as fh:
                return fh.read(200_000)
        with open(path, errors="replace") as fh:
            return fh.read(200_000)
    except OSError:
        return ""


def text_documents() -> dict[str, list[str]]:
    """Source name -> documents (each a string), in a deterministic order."""
    import pydoc_data.topics as pt
    import sysconfig
    docs: dict[str, list[str]] = {"pydoc": [pt.topics[k] for k in sorted(pt.topics)]}
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")) + glob.glob(os.path.join(stdlib, "*", "*.py")))
    docs["stdlib_code"] = [t for t in (_read(f) for f in files if "/test" not in f and "/idlelib" not in f) if t]
    meta = sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "*.dist-info", "METADATA")))
    docs["readmes"] = [t.split("\n\n", 1)[-1] for t in (_read(f) for f in meta) if len(t) > 2000]
    usr = sorted(glob.glob("/usr/share/doc/*/README*") + glob.glob("/usr/share/doc/*/*.txt"))
    docs["usr_doc"] = [t for t in (_read(f) for f in usr) if len(t) > 1000]
    return docs


def text_windows(tok, seed: int) -> list[list[int]]:
    """All WINDOW-token windows of all sources, shuffled with the seed (code 40%, prose 60% by windows)."""
    rng = random.Random(seed)
    per_source: dict[str, list[list[int]]] = {}
    old = tok.model_max_length
    tok.model_max_length = 1 << 30
    for name, docs in text_documents().items():
        wins = []
        for d in docs:
            ids = tok(d, add_special_tokens=False)["input_ids"]
            wins += [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]
        rng.shuffle(wins)
        per_source[name] = wins
        log.info("text source %s: %d docs, %d windows", name, len(docs), len(wins))
    tok.model_max_length = old
    # round-robin over sources with weights, so any prefix of the job list is a balanced mix
    weights = {"stdlib_code": 4, "pydoc": 3, "readmes": 2, "usr_doc": 1}
    out, cursors = [], {k: 0 for k in per_source}
    while True:
        added = False
        for name, w in weights.items():
            wins, c = per_source.get(name, []), cursors.get(name, 0)
            take = wins[c:c + w]
            cursors[name] = c + len(take)
            out += take
            added |= bool(take)
        if not added:
            return out


# ----------------------------------------------------------------------------------------------- scoring
def topk_of(logits: torch.Tensor, k: int = TOPK) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.softmax(logits.float(), dim=-1)
    val, idx = p.topk(k, dim=-1)
    return idx.to(torch.int32), val.to(torch.float16)


@torch.inference_mode()
def score_text(target, windows: list[list[int]]) -> dict:
    ids = torch.tensor(windows)
    logits = target(ids).logits  # [B, W, V]
    idx, val = topk_of(logits.reshape(-1, logits.shape[-1]))
    n = ids.numel()
    offsets = torch.arange(0, n + 1, ids.shape[1], dtype=torch.int64)
    return {"tokens": ids.reshape(-1).to(torch.int32), "offsets": offsets,
            "label_pos": torch.arange(n, dtype=torch.int64), "topk_ids": idx, "topk_p": val}


def generate(gen, tok, prompts: list[list[int]], temperature: float, seed: int) -> dict:
    """The target's own answers (fast_generate.StaticBatchGenerator), labelled with its T = 1 top-k."""
    out = gen.generate(prompts, GEN_TOKENS, temperature, seed, eos_id=tok.eos_token_id, topk=TOPK, batch=GEN_ROWS)
    toks, offsets, label_pos = [], [0], []
    for p, g in zip(prompts, out.tokens):
        seq = p + g
        start = offsets[-1]
        # the token before generated token j sits at len(p) - 1 + j (EOS kept: predicting it is part of p)
        label_pos += [start + len(p) - 1 + j for j in range(len(g))]
        toks += seq
        offsets.append(start + len(seq))
    return {"tokens": torch.tensor(toks, dtype=torch.int32), "offsets": torch.tensor(offsets, dtype=torch.int64),
            "label_pos": torch.tensor(label_pos, dtype=torch.int64), "topk_ids": torch.cat(out.topk_ids),
            "topk_p": torch.cat(out.topk_p)}


# ----------------------------------------------------------------------------------------------- driver
def job_done(job: int, kind: str, out: Path, exported: Optional[Path]) -> bool:
    """A job is done when its shard is in the data directory or, for a generation job, when its answers
    are already exported (``exported``/gen_<job>.npz: a fresh machine then continues with new prompts
    instead of sampling the committed ones again; ``--import-gen`` labels those)."""
    if (out / f"shard_{job:05d}_{kind}.safetensors").exists():
        return True
    return kind == "gen" and exported is not None and (exported / f"gen_{job:05d}.npz").exists()


def run(minutes: float, seed: int, threads: int, kinds=("text", "gen"), part=(0, 1),
        exported: Optional[Path] = GEN_ASSETS, pool: str = "templates") -> None:
    """Jobs in the fixed order; this process does job j when its kind is in ``kinds`` and j % n == i
    for part (i, n), so n processes (one per core) share the list without doing a job twice.  A job is
    not started when less time is left than the last job of its kind took (it would be killed unfinished
    and lost)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    out = data_dir()
    out.mkdir(parents=True, exist_ok=True)
    tdir = paths.target_path()
    tok = AutoTokenizer.from_pretrained(tdir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()  # text scoring
    gen = StaticBatchGenerator(load_model(tdir))  # the target's own answers, static KV (fast_generate.py)
    diverse = pool in DIVERSE_POOLS
    windows = [] if diverse else text_windows(tok, seed)
    prompts = encode(tok, DIVERSE_POOLS[pool][0](tok, seed)) if diverse else train_prompts(tok, seed)
    log.info("job pool: %d text windows, %d generation prompts", len(windows), len(prompts))
    (out / "SOURCES.json").write_text(json.dumps({"seed": seed, "text_windows": len(windows),
                                                 "gen_prompts": len(prompts), "topk": TOPK}, indent=1))
    deadline = time.time() + minutes * 60
    ti = gi = job = 0
    t_start, pos_new = time.time(), 0
    last_s: dict[str, float] = {}  # duration of the last job of each kind
    n_gen = len(prompts) * (1 if diverse else len(GEN_PASSES))  # answer slots: every prompt once per pass
    while time.time() < deadline:
        kind = "gen" if diverse else PATTERN[job % len(PATTERN)]
        num = job + (DIVERSE_POOLS[pool][1] if diverse else 0)  # the job's number in file names and seeds
        path = out / f"shard_{num:05d}_{kind}.safetensors"
        if kind == "text":
            batch, ti = windows[ti:ti + TEXT_BATCH], ti + TEXT_BATCH
        else:  # a job stays inside one pass (one temperature)
            first = gi % len(prompts) if gi < n_gen else len(prompts)
            batch = prompts[first:first + GEN_BATCH]
            temp = (DIVERSE_TEMPS[job % len(DIVERSE_TEMPS)] if diverse
                    else GEN_PASSES[min(gi // len(prompts), len(GEN_PASSES) - 1)])
            gi += len(batch)
        if not batch and kind in kinds:
            log.info("%s pool exhausted", kind)
            break
        if batch and kind in kinds and job % part[1] == part[0] and not job_done(num, kind, out, exported):
            if deadline - time.time() < last_s.get(kind, 0.0):
                log.info("%.1f min left, the last %s job took %.1f: stopping before job %d", (deadline - time.time()) / 60,
                         kind, last_s[kind] / 60, job)
                break
            t_job = time.time()
            if kind == "text":
                shard = score_text(target, batch)
            else:
                shard = generate(gen, tok, batch, temp, seed * 100003 + num)
            tmp = path.with_suffix(".tmp")
            save_file(shard, str(tmp))
            os.replace(tmp, path)
            last_s[kind] = time.time() - t_job
            pos_new += shard["label_pos"].numel()
            el = time.time() - t_start
            sys.stderr.write(f"\rjob {num} ({kind}) +{pos_new} positions, {pos_new / el:.0f} pos/s, "
                             f"{(deadline - time.time()) / 60:.1f} min left   ")
            sys.stderr.flush()
        job += 1
    sys.stderr.write("\n")
    log.info("done: %d new positions in %.1f min", pos_new, (time.time() - t_start) / 60)


# ----------------------------------------------------------------------------------------------- tokens only
def export_gen(dest: Path, directory: Path | None = None) -> int:
    """Every generation shard -> dest/gen_<job>.npz: tokens uint16 [N], offsets int64 [S+1], prompt_lens
    int32 [S] (sequence s = prompt + answer; its labelled positions are the answer's)."""
    import numpy as np

    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for f in sorted(glob.glob(str((directory or data_dir()) / "shard_*_gen.safetensors"))):
        job = int(Path(f).name.split("_")[1])
        out = dest / f"gen_{job:05d}.npz"
        if out.exists():
            continue
        sh = load_file(f)
        tokens, offsets, label_pos = sh["tokens"], sh["offsets"], sh["label_pos"]
        assert int(tokens.max()) < 1 << 16, "vocabulary too large for uint16 tokens"
        # a sequence's labelled positions are its answer's: prompt length = length - their number
        n_lab = torch.searchsorted(label_pos, offsets[1:]) - torch.searchsorted(label_pos, offsets[:-1])
        prompt_lens = (offsets[1:] - offsets[:-1] - n_lab).to(torch.int32)
        tmp = dest / f".gen_{job:05d}.part.npz"  # outside the gen_*.npz glob until complete
        np.savez_compressed(tmp, tokens=tokens.numpy().astype(np.uint16), offsets=offsets.numpy(),
                            prompt_lens=prompt_lens.numpy())
        os.replace(tmp, out)
        n += len(label_pos)
    return n


def gen_label_pos(offsets: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
    """Labelled positions of tokens-only sequences: the token before each answer token."""
    parts = [torch.arange(int(o) + int(p) - 1, int(e) - 1) for o, e, p in zip(offsets[:-1], offsets[1:], prompt_lens)]
    return torch.cat(parts).to(torch.int64) if parts else torch.zeros(0, dtype=torch.int64)


@torch.inference_mode()
def relabel(target, tokens: torch.Tensor, offsets: torch.Tensor, prompt_lens: torch.Tensor, batch: int = 16) -> dict:
    """Teacher-forced labels for tokens-only sequences: the shard generate() would have written."""
    label_pos = gen_label_pos(offsets, prompt_lens)
    seqs = [tokens[int(a):int(b)].long() for a, b in zip(offsets[:-1], offsets[1:])]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths share a padded batch
    ids, ps = [None] * len(seqs), [None] * len(seqs)
    for c in range(0, len(order), batch):
        group = order[c:c + batch]
        width = max(len(seqs[i]) for i in group)
        x = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, i in enumerate(group):
            x[r, :len(seqs[i])], mask[r, :len(seqs[i])] = seqs[i], 1
        logits = target(input_ids=x, attention_mask=mask).logits  # right padding: causal rows unaffected
        for r, i in enumerate(group):
            lo = int(prompt_lens[i]) - 1
            ids[i], ps[i] = topk_of(logits[r, lo:len(seqs[i]) - 1])
    return {"tokens": tokens.to(torch.int32), "offsets": offsets.to(torch.int64), "label_pos": label_pos,
            "topk_ids": torch.cat(ids), "topk_p": torch.cat(ps)}


def hard_label(tokens: torch.Tensor, offsets: torch.Tensor, prompt_lens: torch.Tensor) -> dict:
    """Labels without a target forward: at each answer position, the token the target generated there (one
    sample of its distribution at the pass's temperature; its argmax in a T = 0 pass) with probability 1.
    Cross-entropy against one sample of p has the soft label's expected gradient at T = 1, so this trades
    variance (and a sharper target at T = 0.7 / 0) for the relabelling's ~190 positions/s per core."""
    label_pos = gen_label_pos(offsets, prompt_lens)
    return {"tokens": tokens.to(torch.int32), "offsets": offsets.to(torch.int64), "label_pos": label_pos,
            "topk_ids": tokens[label_pos + 1].to(torch.int32)[:, None],
            "topk_p": torch.ones(len(label_pos), 1, dtype=torch.float16)}


def import_gen(src: Path, threads: int, part=(0, 1), directory: Path | None = None, hard: bool = False) -> int:
    """src/gen_<job>.npz -> labelled shards in the data directory (skips shards already there); ``hard``:
    the generated tokens as labels (hard_label), no target forward."""
    import numpy as np

    torch.set_num_threads(threads)
    out = directory or data_dir()
    out.mkdir(parents=True, exist_ok=True)
    target = None
    if not hard:  # only relabelling runs the target
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(paths.target_path(), dtype=torch.float32).eval()
    n = 0
    for k, f in enumerate(sorted(glob.glob(str(src / "gen_*.npz")))):
        job = int(Path(f).stem.split("_")[1])
        path = out / f"shard_{job:05d}_gen.safetensors"
        if path.exists() or k % part[1] != part[0]:
            continue
        z = np.load(f)
        seqs = (torch.from_numpy(z["tokens"].astype(np.int32)), torch.from_numpy(z["offsets"]),
                torch.from_numpy(z["prompt_lens"]))
        shard = hard_label(*seqs) if hard else relabel(target, *seqs)
        tmp = path.with_suffix(".tmp")
        save_file(shard, str(tmp))
        os.replace(tmp, path)
        n += shard["label_pos"].numel()
        log.info("%s %s: %d positions", "hard-labelled" if hard else "relabelled", Path(f).name,
                 shard["label_pos"].numel())
    return n


def load_shards(directory: Path | None = None, kinds=("text", "gen")) -> list[dict]:
    files = sorted(glob.glob(str((directory or data_dir()) / "shard_*.safetensors")))
    return [load_file(f) for f in files if any(f.endswith(f"_{k}.safetensors") for k in kinds)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stats", action="store_true")
    ap.add_argument("--kinds", default="text,gen", help="job kinds this process does")
    ap.add_argument("--part", default="0/1", help="I/N: this process does every N-th job, from the I-th")
    ap.add_argument("--export-gen", type=Path, help="write the generation shards' tokens to this directory")
    ap.add_argument("--import-gen", type=Path, help="label the tokens-only answers in this directory again")
    ap.add_argument("--hard", action="store_true",
                    help="with --import-gen: the generated tokens as labels (no target forward; see hard_label)")
    ap.add_argument("--prompts", choices=("templates", *DIVERSE_POOLS), default="templates",
                    help="generation prompts: the template pool (prompts_train.train_texts) or a diverse one "
                         "(prompts_diverse: diverse = vocabulary words and stdlib docstrings in the slots, "
                         "diverse2 = held-out-style questions and stdlib methods, diverse3 = everyday nouns, "
                         "phrasing variants and package code)")
    ap.add_argument("--skip-exported", type=Path, default=GEN_ASSETS,
                    help="generation jobs whose answers are exported here count as done (default assets/gen)")
    args = ap.parse_args(argv)
    i, n = (int(x) for x in args.part.split("/"))
    if not 0 <= i < n:
        ap.error("--part must be I/N with 0 <= I < N")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.stats:
        files = sorted(glob.glob(str(data_dir() / "shard_*.safetensors")))
        by = {}
        for f in files:
            k = f.rsplit("_", 1)[-1].split(".")[0]
            m = load_file(f)["label_pos"].numel()
            by[k] = by.get(k, 0) + m
        print(json.dumps({"dir": str(data_dir()), "shards": len(files), "positions": by}, indent=1))
        return 0
    if args.export_gen:
        log.info("exported %d generated positions to %s", export_gen(args.export_gen), args.export_gen)
        return 0
    if args.import_gen:
        log.info("labelled %d generated positions", import_gen(args.import_gen, args.threads, (i, n),
                                                                       hard=args.hard))
        return 0
    run(args.minutes, args.seed, args.threads, tuple(args.kinds.split(",")), (i, n), args.skip_exported, args.prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
