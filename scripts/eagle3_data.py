#!/usr/bin/env python
"""Training data for an EAGLE-3 head: the target's aux hidden states and next-token labels, by teacher forcing.

For each tokens-only job of assets/gen (the target's own answers, scripts/draft_data.py) one forward of the
target (HF transformers, fp32) over every sequence gives, at every position t:
  feats     float16 [N, 3 * D]  the residual stream after layers ``aux`` (HF hidden_states[id + 1]), the
                                 very tensors SGLang captures for an EAGLE-3 draft (inputs of layers id + 1)
  topk_ids  int32  [N, k], topk_p float16 [N, k]   the target's T = 1 top-k for the token after t
  lab       bool   [N]           t is labelled: the token after it is an answer token (not prompt, not past
                                 the sequence's end)
plus tokens / offsets / prompt_lens as in the job.  One safetensors file per job in the data directory
(default ~/.cache/sglang-ssd/eagle3_data); a job already there is skipped, so a stopped run resumes.

    taskset -c 0 python scripts/eagle3_data.py --jobs 10 --part 0/2 &
    taskset -c 1 python scripts/eagle3_data.py --jobs 10 --part 1/2
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from sglang_ssd import paths  # noqa: E402
from sglang_ssd.draft.eagle3 import default_aux_layers  # noqa: E402

log = logging.getLogger("eagle3_data")
TOPK = 32


def data_dir() -> Path:
    return Path(os.environ.get("SGLANG_SSD_EAGLE3_DATA", Path.home() / ".cache/sglang-ssd/eagle3_data"))


@torch.inference_mode()
def featurize(target, aux: list[int], tokens: torch.Tensor, offsets: torch.Tensor, prompt_lens: torch.Tensor,
              batch: int = 16) -> dict:
    n = tokens.numel()
    width = target.config.hidden_size * len(aux)
    feats = torch.zeros(n, width, dtype=torch.float16)
    ids = torch.zeros(n, TOPK, dtype=torch.int32)
    ps = torch.zeros(n, TOPK, dtype=torch.float16)
    lab = torch.zeros(n, dtype=torch.bool)
    spans = [(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]
    order = sorted(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])  # similar lengths per batch
    for c in range(0, len(order), batch):
        group = order[c:c + batch]
        w = max(spans[i][1] - spans[i][0] for i in group)
        x = torch.zeros(len(group), w, dtype=torch.long)
        mask = torch.zeros(len(group), w, dtype=torch.long)
        for r, i in enumerate(group):
            a, b = spans[i]
            x[r, :b - a], mask[r, :b - a] = tokens[a:b].long(), 1
        out = target(input_ids=x, attention_mask=mask, output_hidden_states=True)  # right padding
        hs = torch.cat([out.hidden_states[i + 1] for i in aux], dim=-1)  # [B, w, 3D]
        p = torch.softmax(out.logits.float(), dim=-1)
        val, idx = p.topk(TOPK, dim=-1)
        for r, i in enumerate(group):
            a, b = spans[i]
            feats[a:b] = hs[r, :b - a].half()
            ids[a:b], ps[a:b] = idx[r, :b - a].int(), val[r, :b - a].half()
            lab[a + int(prompt_lens[i]) - 1: b - 1] = True  # the token after is an answer token
    return {"tokens": tokens.to(torch.int32), "offsets": offsets.to(torch.int64),
            "prompt_lens": prompt_lens.to(torch.int32), "feats": feats, "topk_ids": ids, "topk_p": ps,
            "lab": lab, "aux": torch.tensor(aux, dtype=torch.int32)}


def run(src: Path, jobs: int, part: tuple[int, int], threads: int) -> int:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    out = data_dir()
    out.mkdir(parents=True, exist_ok=True)
    target = AutoModelForCausalLM.from_pretrained(paths.target_path(), dtype=torch.float32).eval()
    aux = default_aux_layers(target.config.num_hidden_layers)
    files = sorted(glob.glob(str(src / "gen_*.npz")))[:jobs]
    done = 0
    for k, f in enumerate(files):
        path = out / (Path(f).stem + ".safetensors")
        if path.exists() or k % part[1] != part[0]:
            continue
        z = np.load(f)
        t0 = time.perf_counter()
        shard = featurize(target, aux, torch.from_numpy(z["tokens"].astype(np.int32)),
                          torch.from_numpy(z["offsets"]), torch.from_numpy(z["prompt_lens"]))
        tmp = path.with_suffix(".tmp")
        save_file(shard, str(tmp))
        os.replace(tmp, path)
        n = shard["tokens"].numel()
        done += n
        log.info("%s: %d positions (%d labelled) in %.0f s, %.0f positions/s", path.name, n,
                 int(shard["lab"].sum()), time.perf_counter() - t0, n / (time.perf_counter() - t0))
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=HERE.parent / "assets" / "gen")
    ap.add_argument("--jobs", type=int, default=10, help="the first N jobs of --src")
    ap.add_argument("--part", default="0/1", help="I/N: this process takes every N-th job from the I-th")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    i, n = (int(v) for v in args.part.split("/"))
    run(args.src, args.jobs, (i, n), args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
