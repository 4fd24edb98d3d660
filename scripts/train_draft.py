#!/usr/bin/env python
"""Train a small draft for the prepared target by soft-label distillation (resumable, time-budgeted).

Student: the target's first --layers decoder layers (copied), its embedding (shared, frozen, never stored)
and an output head over the --head-vocab tokens carrying the most teacher probability in the data (initialised
from a closed-form tuned-lens fit, the way scripts/prepare_models.py builds the correctness-grade draft).
Loss: cross-entropy against the target's stored top-k distribution (scripts/draft_data.py), i.e. forward KL
up to a constant, restricted to the head's tokens: the draft's q is exactly 0 elsewhere, so verification
with that q stays exact.

Every --eval-every minutes it measures alpha (greedy and T=1) on the held-out prompts
(scripts/prompts_heldout.json, target greedy trajectories cached once) and appends it to the run's curve;
checkpoints (params, optimiser, data cursor, elapsed time) go to OUT/ckpt.pt, so a stopped run resumes with
the same command. The learning rate follows a cosine over the whole --minutes budget (elapsed time, not steps).

Usage:
    taskset -c 0 python scripts/train_draft.py --out RUN_DIR --layers 2 --head-vocab 8192 --minutes 60
    python scripts/train_draft.py --out RUN_DIR --export assets/draft    # write the committed parameters
    taskset -c 0 python scripts/train_draft.py --out RUN_DIR --init assets/draft --lr 2e-4 --minutes 25  # fine-tune
    taskset -c 0 python scripts/train_draft.py --out RUN_DIR --init assets/draft --grow --layers 4 ...  # deeper
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from draft_data import TOPK, data_dir, load_shards  # noqa: E402
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.config import ModelConfig  # noqa: E402
from sglang_ssd.draft.model import CausalLM  # noqa: E402

log = logging.getLogger("train_draft")
ALWAYS_IN_HEAD = (0, 1, 2)  # <|endoftext|>, <|im_start|>, <|im_end|>: the head must be able to stop


# ----------------------------------------------------------------------------------------------- data
class Pool:
    """Sequences with their labels, from all shards on disk (re-read as the data job adds more)."""

    def __init__(self, val_every: int = 25):
        self.val_every = val_every
        self.train: list[tuple] = []
        self.val: list[tuple] = []
        self.n_files = 0

    def refresh(self) -> None:
        shards = load_shards()
        if len(shards) == self.n_files:
            return
        self.train, self.val = [], []
        for i, sh in enumerate(shards):
            dst = self.val if i % self.val_every == self.val_every - 1 else self.train
            off, lp = sh["offsets"].tolist(), sh["label_pos"]
            for a, b in zip(off, off[1:]):
                sel = ((lp >= a) & (lp < b)).nonzero().squeeze(-1)
                kid, kp = sh["topk_ids"][sel].long(), sh["topk_p"][sel].float()
                if kid.shape[1] < TOPK:  # a hard-label shard (one token, p = 1): pad with p = 0 columns
                    kid = F.pad(kid, (0, TOPK - kid.shape[1]))
                    kp = F.pad(kp, (0, TOPK - kp.shape[1]))
                dst.append((sh["tokens"][a:b].long(), lp[sel] - a, kid, kp))
        self.n_files = len(shards)

    @property
    def positions(self) -> int:
        return sum(len(s[1]) for s in self.train)


def collate(seqs: list[tuple], remap: torch.Tensor):
    """-> ids [B, L], flat label rows (b, pos), teacher targets in head coordinates [M, k] (-1 = not in head)."""
    n = max(len(s[0]) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    rows, tids, tp = [], [], []
    for b, (tok, lpos, kid, kp) in enumerate(seqs):
        ids[b, : len(tok)] = tok
        rows.append(b * n + lpos)
        tids.append(remap[kid])
        tp.append(kp)
    return ids, torch.cat(rows), torch.cat(tids), torch.cat(tp)


def choose_head(pool: Pool, vocab: int, size: int) -> torch.Tensor:
    """The `size` token ids with the most teacher probability over the training data (+ special ids)."""
    mass = torch.zeros(vocab, dtype=torch.float64)
    for _, _, kid, kp in pool.train:
        mass.index_add_(0, kid.reshape(-1), kp.reshape(-1).double())
    mass[list(ALWAYS_IN_HEAD)] = float("inf")
    return mass.topk(size).indices.sort().values


# ----------------------------------------------------------------------------------------------- model
def build_student(layers: int, head_ids: torch.Tensor, lens_tokens: int) -> CausalLM:
    """Target's first `layers` layers + a tuned-lens head restricted to head_ids (fp32)."""
    from tuned_lens import fit_corpus, fit_lens, lens_head
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tdir = paths.target_path()
    hf = json.loads(Path(tdir, "config.json").read_text())
    hf.update(num_hidden_layers=layers, tie_word_embeddings=False, ssd_head_vocab=len(head_ids))
    cfg = ModelConfig.from_hf_dict(hf)
    student = CausalLM(cfg)
    tsd = load_file(os.path.join(tdir, "model.safetensors"))
    sd = {k: v for k, v in tsd.items() if k.startswith("model.") and
          (not k.startswith("model.layers.") or int(k.split(".")[2]) < layers)}
    tok = AutoTokenizer.from_pretrained(tdir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    m = fit_lens(target, fit_corpus(tok, lens_tokens, 256, seed=0), layers, ridge=1e-3)
    sd["lm_head.weight"] = lens_head(tsd["model.embed_tokens.weight"][head_ids], tsd["model.norm.weight"], m)
    sd["model.norm.weight"] = torch.ones_like(tsd["model.norm.weight"])
    sd["head_ids"] = head_ids.clone()
    missing, unexpected = student.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"student state mismatch: {missing} {unexpected}")
    student.model.embed_tokens.requires_grad_(False)  # shared with the target, not trained, not stored
    return student


def grown_layers(missing: list[str], init: dict) -> list[int]:
    """--grow: the decoder layers the student has past --init's (an exported draft of fewer layers)."""
    have = {int(k.split(".")[2]) for k in init if k.startswith("model.layers.")}
    return sorted({int(k.split(".")[2]) for k in missing if k.startswith("model.layers.")} - have)


def grown_keys(student: CausalLM, layers: list[int]) -> list[str]:
    return [k for k, _ in student.named_parameters() if any(k.startswith(f"model.layers.{i}.") for i in layers)]


def load_init(student: CausalLM, init: dict, grow: bool, what: str) -> list[int]:
    """Load an exported draft's parameters into the student; returns the grown layer indices.

    With grow, the student's layers past init's keep the target's weights but their residual writes (o_proj,
    down_proj) are zeroed: each such layer adds 0 to the residual stream, so the grown student computes exactly
    init's function at step 0 and training starts from the trained draft, not from a perturbed one.
    """
    missing, unexpected = student.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                   for k, v in init.items()}, strict=False)
    grown = grown_layers(missing, init) if grow else []
    if unexpected or set(missing) - {"model.embed_tokens.weight"} - set(grown_keys(student, grown)):
        raise RuntimeError(f"{what} does not fit the student: missing {missing}, unexpected {unexpected}")
    for i in grown:
        layer = student.model.layers[i]
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    return grown


def trainable(student: CausalLM) -> dict[str, torch.nn.Parameter]:
    return {k: p for k, p in student.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------------------------- eval
def heldout_reference(cache: Path) -> dict:
    """Target greedy trajectories of the held-out prompts and the target's log-probs along them (cached)."""
    if cache.exists():
        return torch.load(cache)
    from measure_draft import greedy_trajectories, load_prompts, position_logprobs
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(paths.target_path())
    target = AutoModelForCausalLM.from_pretrained(paths.target_path(), dtype=torch.float32).eval()
    prompts = load_prompts()
    seqs = greedy_trajectories(target, tok, prompts, 64)
    ref = {"kinds": [p["kind"] for p in prompts], "seqs": [(ids[0], plen) for ids, plen in seqs],
           "logp": [lp.half() for lp in position_logprobs(target, seqs)]}
    torch.save(ref, cache)
    return ref


@torch.no_grad()
def alpha(student: CausalLM, ref: dict) -> dict:
    """alpha greedy / T=1 per kind on the held-out trajectories (the measure_draft.py definitions)."""
    student.eval()
    res: dict[str, list] = {}
    for kind, (ids, plen), tlp in zip(ref["kinds"], ref["seqs"], ref["logp"]):
        h = student.forward_padded(ids[None])[0, plen - 1: len(ids) - 1]
        qlp = torch.log_softmax(student.logits(h), -1)
        p = tlp.float().exp()
        g = (p.argmax(-1) == qlp.argmax(-1)).float()
        o = torch.minimum(p, qlp.exp()).sum(-1)
        for k in (kind, "all"):
            res.setdefault(k, []).append((g, o))
    student.train()
    return {k: {"alpha_greedy": round(torch.cat([a for a, _ in v]).mean().item(), 4),
                "alpha_t1": round(torch.cat([b for _, b in v]).mean().item(), 4)} for k, v in res.items()}


@torch.no_grad()
def val_loss(student: CausalLM, pool: Pool, remap: torch.Tensor, limit: int = 64) -> float:
    student.eval()
    tot, n = 0.0, 0
    for i in range(0, min(limit, len(pool.val)), 8):
        ids, rows, tids, tp = collate(pool.val[i:i + 8], remap)
        tot += kd_loss(student, ids, rows, tids, tp).item() * len(rows)
        n += len(rows)
    student.train()
    return tot / max(n, 1)


def kd_loss(student, ids, rows, tids, tp) -> torch.Tensor:
    # CE(p_teacher, q_student) = -sum_j p_j log q_j over the teacher's top-k tokens that the head has
    h = student.forward_padded(ids).reshape(-1, student.cfg.hidden_size)[rows]
    logq = torch.log_softmax(student.head_logits(h), -1)
    ok = tids >= 0
    picked = logq.gather(1, tids.clamp_min(0)) * ok
    return -(picked * tp).sum(-1).mean()


# ----------------------------------------------------------------------------------------------- train
def train(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    pool = Pool()
    pool.refresh()
    ckpt_path = out / "ckpt.pt"
    ck = torch.load(ckpt_path) if ckpt_path.exists() else None
    if args.init and ck:
        log.info("--init ignored: resuming %s", ckpt_path)
    init = load_file(str(Path(args.init) / "draft.safetensors")) if args.init and not ck else None
    head_ids = ck["head_ids"] if ck else init["head_ids"] if init else choose_head(pool, 49152, args.head_vocab)
    if init is not None:
        args.head_vocab = len(head_ids)  # the initial draft's head decides (checkpoint args, export)
    student = build_student(args.layers, head_ids, args.lens_tokens)
    if init is not None:  # fine-tune an exported draft (its fp16 parameters, its head) instead of the lens start
        grown = load_init(student, init, args.grow, f"--init {args.init} --layers {args.layers}")
        log.info("initialised from %s%s", args.init, f" + layers {grown} (the target's, residual writes zeroed)"
                 if grown else "")
    remap = torch.full((student.cfg.vocab_size,), -1, dtype=torch.long)
    remap[head_ids] = torch.arange(len(head_ids))
    params = trainable(student)
    opt = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    elapsed, step, seen, curve = 0.0, 0, 0, []
    if ck:
        student.load_state_dict(ck["params"], strict=False)
        opt.load_state_dict(ck["opt"])
        elapsed, step, seen, curve = ck["elapsed"], ck["step"], ck["seen"], ck["curve"]
        log.info("resumed at step %d, %.1f min, %d positions seen", step, elapsed / 60, seen)
    ref = heldout_reference(data_dir() / "heldout_ref.pt")
    rng = random.Random(args.seed + step)
    budget = args.minutes * 60
    if not curve:
        curve.append({"positions": 0, "minutes": 0.0, "alpha": alpha(student, ref), "val_loss": val_loss(student, pool, remap)})
        log.info("start: %s", curve[-1])
    t_last = time.time()
    last_eval = last_ckpt = last_refresh = elapsed
    student.train()
    while elapsed < budget:
        lr = args.lr * (min(1.0, elapsed / 60 / args.warmup_min) if args.warmup_min else 1.0) \
            * 0.5 * (1 + math.cos(math.pi * elapsed / budget))
        for gr in opt.param_groups:
            gr["lr"] = lr
        batch, ntok = [], 0
        while ntok < args.batch_tokens:
            s = pool.train[rng.randrange(len(pool.train))]
            batch.append(s)
            ntok += len(s[0])
        ids, rows, tids, tp = collate(batch, remap)
        loss = kd_loss(student, ids, rows, tids, tp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        step += 1
        seen += len(rows)
        now = time.time()
        elapsed += now - t_last
        t_last = now
        sys.stderr.write(f"\rstep {step} loss {loss.item():.3f} lr {lr:.2e} seen {seen} "
                         f"({elapsed / 60:.1f}/{args.minutes:.0f} min, pool {pool.positions})   ")
        done = elapsed >= budget
        if done or elapsed - last_eval >= args.eval_every * 60:
            curve.append({"positions": seen, "minutes": round(elapsed / 60, 2), "step": step,
                          "pool_positions": pool.positions, "alpha": alpha(student, ref),
                          "val_loss": round(val_loss(student, pool, remap), 4)})
            log.info("\n%s", json.dumps(curve[-1]))
            last_eval = elapsed
        if done or elapsed - last_ckpt >= args.ckpt_every * 60:
            state = {"params": {k: v.detach() for k, v in student.state_dict().items() if k != "model.embed_tokens.weight"},
                     "opt": opt.state_dict(), "head_ids": head_ids, "elapsed": elapsed, "step": step,
                     "seen": seen, "curve": curve, "args": vars(args)}
            torch.save(state, out / "ckpt.tmp")
            os.replace(out / "ckpt.tmp", ckpt_path)
            (out / "curve.json").write_text(json.dumps({"args": vars(args), "curve": curve}, indent=1))
            last_ckpt = elapsed
            t_last = time.time()  # do not charge checkpoint/eval time to the budget
        if elapsed - last_refresh >= 300:
            pool.refresh()
            last_refresh = elapsed
            t_last = time.time()
    log.info("done: %d steps, %d positions seen", step, seen)


def load_run(run_dir: Path, round_fp16: bool = False) -> tuple[CausalLM, dict]:
    """A run's student from its checkpoint + the target's embedding (optionally with fp16-rounded params,
    exactly as the exported asset stores them)."""
    ck = torch.load(Path(run_dir) / "ckpt.pt")
    a = ck["args"]
    tdir = paths.target_path()
    hf = json.loads(Path(tdir, "config.json").read_text())
    hf.update(num_hidden_layers=a["layers"], tie_word_embeddings=False, ssd_head_vocab=a["head_vocab"])
    m = CausalLM(ModelConfig.from_hf_dict(hf))
    sd = {k: (v.half().float() if round_fp16 and v.is_floating_point() else v) for k, v in ck["params"].items()}
    sd["model.embed_tokens.weight"] = load_file(os.path.join(tdir, "model.safetensors"))["model.embed_tokens.weight"]
    m.load_state_dict(sd, strict=True)
    info = {"layers": a["layers"], "head_vocab": a["head_vocab"], "train_minutes": round(ck["elapsed"] / 60, 1),
            "positions_seen": ck["seen"], "steps": ck["step"], "curve": ck["curve"], "args": a}
    return m.eval().requires_grad_(False), info


def export(args) -> None:
    """Write the parameters that cannot be derived from the target (fp16) + meta to --export DIR."""
    from trained_draft import probe_argmax
    from transformers import AutoTokenizer
    ck = torch.load(Path(args.out) / "ckpt.pt")
    dst = Path(args.export)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in ck["params"].items()}
    save_file(tensors, str(dst / "draft.safetensors"))
    model, info = load_run(Path(args.out), round_fp16=True)
    meta = {"layers": info["layers"], "head_vocab": info["head_vocab"], "steps": info["steps"],
            "positions_seen": info["positions_seen"], "train_minutes": info["train_minutes"],
            "final": info["curve"][-1], "args": info["args"],
            "probe_argmax": probe_argmax(model, AutoTokenizer.from_pretrained(paths.target_path())),
            "stored": "decoder layers, final norm, reduced lm_head and its token ids (fp16); the embedding is "
                      "the target's and is taken from it at preparation time"}
    (dst / "draft.json").write_text(json.dumps(meta, indent=1) + "\n")
    (dst / "curve.json").write_text(json.dumps(info["curve"], indent=1) + "\n")
    log.info("exported %s (%.1f MB)", dst, (dst / "draft.safetensors").stat().st_size / 1e6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="run directory (checkpoint, curve)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-vocab", type=int, default=8192)
    ap.add_argument("--minutes", type=float, default=60.0, help="training time budget (total over resumes)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-min", type=float, default=1.0)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lens-tokens", type=int, default=4096)
    ap.add_argument("--eval-every", type=float, default=5.0, help="minutes")
    ap.add_argument("--ckpt-every", type=float, default=5.0, help="minutes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export", default=None, help="write the trained parameters to this dir and exit")
    ap.add_argument("--init", default=None, help="start from an exported draft (e.g. assets/draft): fine-tuning")
    ap.add_argument("--grow", action="store_true",
                    help="with --init of fewer layers than --layers: append the target's next layers with their "
                         "residual writes (o_proj, down_proj) zeroed, so training starts from --init's function")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)
    if args.export:
        export(args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
