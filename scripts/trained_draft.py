"""Assemble the trained draft (issue 4) from the parameters committed under assets/draft/ and the target.

assets/draft/draft.safetensors holds only what training changed (decoder layers, final norm, the reduced
lm_head and its token ids, fp16); the embedding is the target's and is copied from the prepared target here.
The result is a draft directory our draft runner loads (config.json with ``ssd_head_vocab``); it is not a
plain transformers checkpoint because its head covers a token subset (q = 0 elsewhere).
A probe (argmax of fixed inputs, recorded at export time) guards the assembly.  The directory also gets the
draft's datastore (sglang_ssd/saguaro/datastore.py), built from the target's own answers in assets/gen/.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from sglang_ssd.saguaro.datastore import FILE_NAME as DATASTORE_FILE
from sglang_ssd.saguaro.datastore import Datastore

log = logging.getLogger("prepare_models")
ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "draft"
GEN_DIR = ASSET_DIR.parent / "gen"  # the target's own answers (tokens only, assets/gen/README.md)
PROBE_TEXT = ("The capital of France is Paris.\ndef add(a, b):\n    return a + b\n"
              "Question: What is 3 + 4?\nAnswer: 7")


def probe_argmax(model, tok) -> list[int]:
    ids = torch.tensor(tok(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        h = model.forward_padded(ids[None])[0]
        return model.logits(h).argmax(-1).tolist()


def gen_answers(gen_dir: Path = GEN_DIR):
    """(prompt + answer tokens, prompt length) of every answer in gen_dir's gen_*.npz files."""
    for f in sorted(gen_dir.glob("gen_*.npz")):
        with np.load(f) as z:
            toks, offs, plens = z["tokens"].astype(np.int64), z["offsets"], z["prompt_lens"]
        for s in range(len(plens)):
            yield toks[offs[s]:offs[s + 1]], int(plens[s])


def write_datastore(out: Path, gen_dir: Path = GEN_DIR) -> int:
    """Build the draft's datastore from the target's answers into out/datastore.npz; -> its size."""
    store = Datastore.build(gen_answers(gen_dir))
    store.save(out / DATASTORE_FILE)
    log.info("datastore: %d continuations from %s", len(store), gen_dir)
    return len(store)


def draft_config(target_cfg: dict, layers: int, head_vocab: int) -> dict:
    cfg = dict(target_cfg)
    cfg.update(num_hidden_layers=layers, tie_word_embeddings=False, ssd_head_vocab=head_vocab,
               ssd_note="sglang-ssd draft: lm_head covers the token ids in head_ids only; load with sglang_ssd")
    if cfg.get("layer_types"):
        cfg["layer_types"] = list(cfg["layer_types"])[:layers]
    return cfg


def assemble(tdir: Path, out: Path, tokenizer_files, asset_dir: Path = ASSET_DIR) -> dict:
    """Write the trained draft into `out` (an empty temp dir); returns the asset's meta."""
    from transformers import AutoTokenizer

    from sglang_ssd.draft.model import load_model
    meta = json.loads((asset_dir / "draft.json").read_text())
    params = {k: (v.float() if v.is_floating_point() else v) for k, v in
              load_file(str(asset_dir / "draft.safetensors")).items()}
    t_state = load_file(str(tdir / "model.safetensors"))
    params["model.embed_tokens.weight"] = t_state["model.embed_tokens.weight"]
    cfg = draft_config(json.loads((tdir / "config.json").read_text()), meta["layers"], meta["head_vocab"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in params.items()}, str(out / "model.safetensors"))
    shutil.copy2(tdir / "generation_config.json", out / "generation_config.json")
    for name in tokenizer_files:
        if (tdir / name).exists():
            shutil.copy2(tdir / name, out / name)
    model = load_model(str(out))
    got = probe_argmax(model, AutoTokenizer.from_pretrained(str(out)))
    if got != meta["probe_argmax"]:
        raise RuntimeError("assembled draft does not reproduce the exported probe (wrong target or asset?)")
    log.info("trained draft assembled: %d layers, head %d tokens, probe ok", meta["layers"], meta["head_vocab"])
    return dict(meta, datastore=write_datastore(out))
