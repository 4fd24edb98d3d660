#!/usr/bin/env python
"""Train an EAGLE-3 head for the SmolLM2 target with training-time test, saved in the published layout.

Data: scripts/eagle3_data.py's shards (the target's own answers with its aux hidden states and top-k
labels).  The head: one decoder layer on [embedding ; feature] (q/k/v over 2D columns), ``fc`` over the
three aux states, the target's final norm and a draft vocabulary of 8,192 ids (the default standalone
draft's head: ``d2t`` / ``t2d``); the embedding is the target's, frozen and not saved (SpecForge's
layout, which eagle3.load_draft and SGLang read).  Initialisation: the decoder layer from the target's
last layer (its q/k/v weights on both halves of the input), fc selecting the deepest aux state, the
lm_head rows from the target's tied embedding.  Loss: soft cross-entropy against the target's top-k at
every TTT step s, weighted 0.8^s (SpecForge's weights; eagle3_ttt.py has the step layout).

Held-out evaluation (scripts/prompts_heldout.json, target greedy trajectories, 64 tokens, as
draft_quality.py): per step s, alpha greedy (argmax q = the target's token) and alpha T=1
(sum min(p, q)) -- step s is the (s+1)-th token past the last target feature, which is what a cached SSD
speculation drafts at (s = k + j for the j-th token after k accepted).  Checkpoints resume.

    taskset -c 0,1 python scripts/train_eagle3.py --minutes 40 --out ~/.cache/sglang-ssd/eagle3_run
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from eagle3_data import data_dir, featurize  # noqa: E402
from eagle3_ttt import shift, soft_ce, step_targets, ttt_forward  # noqa: E402
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.eagle3 import ARCH, Eagle3Config, Eagle3Draft, default_aux_layers  # noqa: E402

log = logging.getLogger("train_eagle3")
DECAY = 0.8


def head_config(target_cfg: dict, draft_vocab: int, aux: list[int]) -> dict:
    """The published EAGLE-3 config: the target's Llama shape with one layer, the draft vocabulary size and
    the feature layers."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_parameters", "rope_theta", "max_position_embeddings", "vocab_size",
            "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")
    cfg = {k: target_cfg[k] for k in keep if k in target_cfg}
    cfg.update(architectures=[ARCH], model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
               draft_vocab_size=draft_vocab, target_hidden_size=target_cfg["hidden_size"],
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux)})
    return cfg


def init_head(target_dir: str, head_ids: torch.Tensor) -> tuple[Eagle3Draft, dict]:
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tw = load_file(str(Path(target_dir) / "model.safetensors"))
    aux = default_aux_layers(int(tcfg["num_hidden_layers"]))
    hf = head_config(tcfg, len(head_ids), aux)
    model = Eagle3Draft(Eagle3Config.from_hf_dict(hf))
    last = f"model.layers.{tcfg['num_hidden_layers'] - 1}."
    emb = tw["model.embed_tokens.weight"]
    lay = model.layers[0]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(emb)
        for n in ("q_proj", "k_proj", "v_proj"):
            w = tw[last + f"self_attn.{n}.weight"]
            getattr(lay.self_attn, n).weight.copy_(torch.cat([0.5 * w, w], dim=1))
        lay.self_attn.o_proj.weight.copy_(tw[last + "self_attn.o_proj.weight"])
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(lay.mlp, n).weight.copy_(tw[last + f"mlp.{n}.weight"])
        lay.hidden_norm.weight.copy_(tw[last + "input_layernorm.weight"])
        lay.input_layernorm.weight.copy_(tw[last + "input_layernorm.weight"])
        lay.post_attention_layernorm.weight.copy_(tw[last + "post_attention_layernorm.weight"])
        d = tcfg["hidden_size"]
        fc = torch.zeros(d, d * len(aux))
        fc[:, -d:] = torch.eye(d)  # g = the deepest aux state at the start
        model.fc.weight.copy_(fc + 0.01 * torch.randn_like(fc))
        model.norm.weight.copy_(tw["model.norm.weight"])
        model.lm_head.weight.copy_(emb[head_ids])
        model.head_ids.copy_(head_ids)
    model.embed_tokens.weight.requires_grad_(False)
    return model, hf


def save_head(model: Eagle3Draft, hf: dict, out: Path) -> None:
    """config.json + model.safetensors, SpecForge's key names (midlayer.*, fc, norm, lm_head, d2t, t2d)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith(("embed_tokens.", "head_ids", "inv_freq")):
            continue
        state[k.replace("layers.0.", "midlayer.")] = v.detach().half().contiguous()
    ids = model.head_ids.cpu()
    state["d2t"] = (ids - torch.arange(len(ids))).long()
    t2d = torch.zeros(hf["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    state["t2d"] = t2d
    (out / "config.json").write_text(json.dumps({**hf, "torch_dtype": "float16"}, indent=1))
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.replace(out / "model.safetensors")


# ------------------------------------------------------------------------------------------------ data
class Pool:
    """Every sequence of the shards: (shard, start, end), batches of similar lengths."""

    def __init__(self, files: list[str]):
        self.shards = [load_file(f) for f in files]
        self.seqs = [(i, int(a), int(b)) for i, s in enumerate(self.shards)
                     for a, b in zip(s["offsets"][:-1].tolist(), s["offsets"][1:].tolist())]
        self.labelled = sum(int(s["lab"].sum()) for s in self.shards)

    def batches(self, tokens_per_batch: int, rng: random.Random):
        order = sorted(range(len(self.seqs)), key=lambda i: (self.seqs[i][2] - self.seqs[i][1], rng.random()))
        chunks, cur, width = [], [], 0
        for i in order:
            n = self.seqs[i][2] - self.seqs[i][1]
            if cur and max(width, n) * (len(cur) + 1) > tokens_per_batch:
                chunks.append(cur)
                cur, width = [], 0
            cur.append(i)
            width = max(width, n)
        if cur:
            chunks.append(cur)
        rng.shuffle(chunks)
        for c in chunks:
            yield self.collate(c)

    def collate(self, idx: list[int]) -> dict:
        w = max(self.seqs[i][2] - self.seqs[i][1] for i in idx)
        first = self.shards[0]
        out = {"tokens": torch.zeros(len(idx), w, dtype=torch.long),
               "feats": torch.zeros(len(idx), w, first["feats"].shape[1], dtype=torch.float16),
               "ids": torch.zeros(len(idx), w, first["topk_ids"].shape[1], dtype=torch.int32),
               "p": torch.zeros(len(idx), w, first["topk_p"].shape[1], dtype=torch.float16),
               "lab": torch.zeros(len(idx), w, dtype=torch.bool), "valid": torch.zeros(len(idx), w, dtype=torch.bool)}
        for r, i in enumerate(idx):
            s, a, b = self.seqs[i]
            sh = self.shards[s]
            n = b - a
            out["tokens"][r, :n] = sh["tokens"][a:b].long()
            out["feats"][r, :n] = sh["feats"][a:b]
            out["ids"][r, :n], out["p"][r, :n] = sh["topk_ids"][a:b], sh["topk_p"][a:b]
            out["lab"][r, :n], out["valid"][r, :n] = sh["lab"][a:b], True
        return out


def heldout(cache: Path) -> dict:
    """Held-out greedy trajectories (train_draft's, with the target's log-probs at each generated position)
    as one labelled batch with the target's features."""
    if cache.exists():
        return torch.load(cache)
    from draft_data import data_dir as labels_dir
    from train_draft import heldout_reference
    from transformers import AutoModelForCausalLM

    labels_dir().mkdir(parents=True, exist_ok=True)
    ref = heldout_reference(labels_dir() / "heldout_ref.pt")
    target = AutoModelForCausalLM.from_pretrained(paths.target_path(), dtype=torch.float32).eval()
    toks = torch.cat([ids for ids, _ in ref["seqs"]])
    offsets = torch.tensor([0] + [len(ids) for ids, _ in ref["seqs"]]).cumsum(0)
    plens = [int(p) for _, p in ref["seqs"]]
    sh = featurize(target, default_aux_layers(target.config.num_hidden_layers), toks.int(), offsets,
                   torch.tensor(plens), batch=4)
    sh.update(logp=ref["logp"], kinds=ref["kinds"], plens=plens)  # logp row i: position plen - 1 + i
    torch.save(sh, cache)
    return sh


@torch.no_grad()
def evaluate(model: Eagle3Draft, ref: dict, steps: int) -> dict:
    """Per TTT step: alpha greedy and alpha T=1 on the held-out trajectories, overall and by kind."""
    model.eval()
    res: dict = {}
    offs = ref["offsets"].tolist()
    for r, (kind, lp, plen) in enumerate(zip(ref["kinds"], ref["logp"], ref["plens"])):
        a, b = offs[r], offs[r + 1]
        valid = torch.ones(1, b - a, dtype=torch.bool)
        lab = ref["lab"][a:b][None]
        outs = ttt_forward(model, ref["tokens"][a:b].long()[None], ref["feats"][a:b][None].float(), valid, steps)
        for s, (h, m) in enumerate(zip(outs, step_targets(valid, lab, steps))):
            sel = m[0].nonzero().flatten()
            if not len(sel):
                continue
            q = torch.softmax(model.head_logits(h[0, sel]), -1)
            full_p = lp[sel + s - (plen - 1)].float().exp()               # the target at position t + s
            p = full_p[:, model.head_ids]
            g = (p.argmax(-1) == q.argmax(-1)) & (model.head_ids[p.argmax(-1)] == full_p.argmax(-1))
            o = torch.minimum(p, q).sum(-1)
            for k in (kind, "all"):
                e = res.setdefault(k, {}).setdefault(s, [0.0, 0.0, 0])
                e[0] += g.float().sum().item()
                e[1] += o.sum().item()
                e[2] += len(sel)
    model.train()
    return {k: {s: {"alpha_greedy": round(v[0] / v[2], 4), "alpha_t1": round(v[1] / v[2], 4), "n": v[2]}
                for s, v in d.items()} for k, d in res.items()}


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    files = sorted(glob.glob(str(data_dir() / "gen_*.safetensors")))
    if not files:
        raise SystemExit(f"no shards in {data_dir()}: run scripts/eagle3_data.py first")
    pool = Pool(files)
    log.info("%d shards, %d sequences, %d labelled positions", len(files), len(pool.seqs), pool.labelled)
    head_ids = load_file(str(Path(paths.draft_path()) / "model.safetensors"))["head_ids"]
    model, hf = init_head(paths.target_path(), head_ids.sort().values.long())
    t2d = torch.full((hf["vocab_size"],), -1, dtype=torch.long)
    t2d[model.head_ids] = torch.arange(len(model.head_ids))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    ref = heldout(data_dir() / "heldout_eagle3.pt")
    ckpt = args.out / "train_state.pt"
    state = {"seen": 0, "step": 0, "elapsed": 0.0, "curve": []}
    if ckpt.exists():
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log.info("resumed at %d positions seen", state["seen"])
    else:
        state["curve"].append({"seen": 0, "eval": evaluate(model, ref, args.steps)["all"]})
    budget = args.minutes * 60
    total = args.total_positions
    t_start, last_eval, last_ckpt = time.perf_counter(), time.perf_counter(), time.perf_counter()
    model.train()
    done = False
    while not done:
        for batch in pool.batches(args.tokens_per_batch, rng):
            frac = min(state["seen"] / total, 1.0)
            lr = args.lr * min(1.0, (state["step"] + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for gparam in opt.param_groups:
                gparam["lr"] = lr
            outs = ttt_forward(model, batch["tokens"], batch["feats"].float(), batch["valid"], args.steps)
            loss, n_pos = 0.0, 0
            for s, (h, m) in enumerate(zip(outs, step_targets(batch["valid"], batch["lab"], args.steps))):
                if not m.any():
                    continue
                ls = soft_ce(model.head_logits(h[m]), shift(batch["ids"], s)[m], shift(batch["p"], s)[m], t2d)
                loss = loss + DECAY ** s * ls
                n_pos = n_pos if s else int(m.sum())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            state["seen"] += n_pos
            state["step"] += 1
            now = time.perf_counter()
            elapsed = state["elapsed"] + now - t_start
            if state["step"] % 20 == 0:
                log.info("step %d seen %d loss %.3f lr %.2e %.0f positions/s", state["step"], state["seen"],
                         float(loss), lr, state["seen"] / max(elapsed, 1e-9))
            if now - last_eval > args.eval_minutes * 60:
                ev = evaluate(model, ref, args.steps)
                state["curve"].append({"seen": state["seen"], "eval": ev["all"]})
                log.info("eval at %d: %s", state["seen"], {s: (v["alpha_greedy"], v["alpha_t1"]) for s, v in ev["all"].items()})
                last_eval = time.perf_counter()
            if now - last_ckpt > 300 or elapsed > budget or state["seen"] >= total:
                state["elapsed"] = elapsed
                t_start, last_ckpt = time.perf_counter(), time.perf_counter()
                args.out.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
                save_head(model, hf, args.out / "head")
            if elapsed > budget or state["seen"] >= total:
                done = True
                break
    ev = evaluate(model, ref, args.steps)
    state["curve"].append({"seen": state["seen"], "eval": ev["all"]})
    save_head(model, hf, args.out / "head")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
    result = {"positions_seen": state["seen"], "steps": state["step"], "train_min": round(state["elapsed"] / 60, 1),
              "pool_positions": pool.labelled, "ttt_steps": args.steps, "threads": args.threads, "final": ev, "curve": state["curve"]}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def write_report(result: dict, path: Path) -> None:
    """results/eagle3_quality.{json,md}: held-out alpha per TTT step and kind, and the curve."""
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.machine())
    path.with_suffix(".json").write_text(json.dumps(result, indent=1))
    fin = result["final"]
    steps = sorted(int(s) for s in fin["all"])
    lines = [f"# EAGLE-3 head for SmolLM2-135M, trained with training-time test (issue 15)", "",
             f"Machine: {cpu}, torch {torch.__version__}, "
             f"{result.get('threads', 2)} threads. {result['train_min']} min, {result['positions_seen']:,} positions seen "
             f"(x {result['ttt_steps']} TTT steps) of a {result['pool_positions']:,}-position pool (scripts/eagle3_data.py "
             "over the first jobs of assets/gen). Held-out: scripts/prompts_heldout.json, target greedy, 64 tokens. "
             "Step s = the (s+1)-th token drafted past the last target feature, conditional on the tokens before it "
             "being the target's (a cached SSD speculation after k accepted drafts its j-th token at step k + j; a "
             "backup's first token is step 0).", "",
             "| step | " + " | ".join(f"alpha greedy / T=1, {k}" for k in sorted(fin)) + " |",
             "|---|" + "---|" * len(fin)]
    for s in steps:
        lines.append(f"| {s} | " + " | ".join(f"{fin[k][str(s)]['alpha_greedy']:.3f} / {fin[k][str(s)]['alpha_t1']:.3f}"
                                             for k in sorted(fin)) + " |")
    lines += ["", "Curve (all kinds; alpha greedy / T=1 per step, against positions seen):", ""]
    for c in result["curve"]:
        lines.append(f"- {c['seen']:,}: " + ", ".join(f"s{s} {v['alpha_greedy']:.3f}/{v['alpha_t1']:.3f}"
                                                     for s, v in sorted(c["eval"].items(), key=lambda x: int(x[0]))))
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/sglang-ssd/eagle3_run")
    ap.add_argument("--minutes", type=float, default=40)
    ap.add_argument("--steps", type=int, default=5, help="TTT steps (tokens past the last target feature)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument("--total-positions", type=int, default=1_000_000, help="the LR schedule's length")
    ap.add_argument("--eval-minutes", type=float, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", type=Path, help="only write this report (e.g. results/eagle3_quality.md) "
                    "from --out's result.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.report:
        write_report(json.loads((args.out / "result.json").read_text()), args.report)
        return 0
    res = train(args)
    log.info("done: %s", json.dumps({k: v for k, v in res.items() if k != "curve"})[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
