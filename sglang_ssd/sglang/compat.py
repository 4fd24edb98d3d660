"""Launch-time checks that target and draft can speculate for each other."""

from __future__ import annotations

import json
import os

from sglang_ssd.config import DRAFT_FLAG, SaguaroConfigError


def _read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return {}


def check_draft_matches_target(target_path: str, draft_path: str) -> None:
    """The draft must share the target's vocabulary (same size, same tokenizer vocab when both
    directories carry a tokenizer.json); otherwise its tokens mean nothing to the target."""
    if not os.path.isdir(target_path):
        return  # a hub id: SGLang resolves it later; nothing local to compare
    t_cfg = _read_json(os.path.join(target_path, "config.json"))
    d_cfg = _read_json(os.path.join(draft_path, "config.json"))
    tv, dv = t_cfg.get("vocab_size"), d_cfg.get("vocab_size")
    if tv is not None and dv is not None and tv != dv:
        raise SaguaroConfigError(
            f"{DRAFT_FLAG}: draft vocab_size {dv} differs from the target's {tv}; "
            "the draft must share the target's tokenizer and vocabulary")
    t_tok = _read_json(os.path.join(target_path, "tokenizer.json")).get("model", {}).get("vocab")
    d_tok = _read_json(os.path.join(draft_path, "tokenizer.json")).get("model", {}).get("vocab")
    if t_tok and d_tok and t_tok != d_tok:
        raise SaguaroConfigError(
            f"{DRAFT_FLAG}: the draft's tokenizer vocabulary differs from the target's "
            "(tokenizer.json); the draft must share the target's tokenizer")


def resolved_args(server_args):
    """The server arguments as SGLang resolved them.  SGLang 0.5.23 keeps a ServerArgs' raw input in its fields
    and what launch-time handlers decided (SaguaroAlgo.handle_server_args: K when not given, K+1, topk) as
    declarations that survive pickling into the scheduler process; its own code reads them through a resolving
    view (runtime_context.get_spec()).  Reading the raw field would give None for a K the plugin chose."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view
    except ImportError:  # another SGLang layout: fields are the resolved values
        return server_args
    return resolving_view(server_args)
