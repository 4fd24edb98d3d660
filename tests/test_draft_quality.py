"""The round simulation behind scripts/draft_quality.py's predictions (pure tensor logic)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from draft_quality import predict, rounds_greedy, rounds_sampled, training_record  # noqa: E402

V = 6


def _seq(tok, q):
    p = torch.nn.functional.one_hot(torch.tensor(tok), V).float()
    return [{"kind": "x", "p": p, "q": q, "tok": torch.tensor(tok)}]


def test_perfect_draft_accepts_everything_and_always_hits():
    tok = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    q = torch.nn.functional.one_hot(torch.tensor(tok), V).float() * 0.9 + 0.1 / V
    e, hit = rounds_greedy(_seq(tok, q), k=3, f=1)
    assert e == 4.0 and hit == 1.0
    e1, hit1 = rounds_sampled(_seq(tok, q), k=3, f=1)
    assert 1.0 < e1 <= 4.0 and 0.0 <= hit1 <= 1.0


def test_wrong_argmax_hits_only_when_the_token_is_the_runner_up():
    tok = [1, 1, 1, 1, 1, 1]
    q = torch.full((6, V), 0.01)
    q[:, 0], q[:, 1] = 0.6, 0.3           # draft argmax 0 (always rejected); target token 1 is its runner-up
    e, hit = rounds_greedy(_seq(tok, q), k=2, f=1)
    assert e == 1.0 and hit == 1.0        # top-F guesses exclude the rejected draft token
    q[:, 1], q[:, 2] = 0.01, 0.3          # now the runner-up is 2: every round misses
    assert rounds_greedy(_seq(tok, q), k=2, f=1) == (1.0, 0.0)
    assert rounds_greedy(_seq(tok, q), k=2, f=5)[1] == 1.0


def test_prediction_formula():
    c_d = {"step_1": 10.0, "extend_4": 12.0, "tree_12": 20.0}
    c_t = {"step_1": 100.0, "extend_4": 150.0}
    r = predict(c_d, c_t, e=2.0, p_hit=0.5, k=3, f=3)
    # SD: 2 tokens per 3*10 + 150 ms; SSD: 0.5 * max(150, 12 + 3*20) + 0.5 * (150 + 30)
    assert abs(r["sd_tok_s"] - 2000 / 180) < 0.01 and abs(r["ssd_tok_s"] - 2000 / 165) < 0.01
    assert abs(r["T_p"] - 72 / 150) < 1e-3 and r["ar_tok_s"] == 10.0


def test_training_record_of_a_prepared_draft(tmp_path):
    """A prepared dir names its training run by its draft.json (+ curve.json); none -> {} (not 0 minutes)."""
    import json

    assert training_record(tmp_path) == {}
    (tmp_path / "draft.json").write_text(json.dumps({"train_minutes": 36.0, "positions_seen": 123, "layers": 2}))
    (tmp_path / "curve.json").write_text(json.dumps([{"positions": 0, "minutes": 0.0}]))
    assert training_record(tmp_path) == {"train_minutes": 36.0, "positions_seen": 123,
                                         "curve": [{"positions": 0, "minutes": 0.0}]}
    # a dir assembled from assets/draft (PREPARED.json's asset_sha256) reads the committed record instead
    import hashlib
    asset = Path(__file__).resolve().parent.parent / "assets" / "draft"
    sha = hashlib.sha256((asset / "draft.safetensors").read_bytes()).hexdigest()
    (tmp_path / "PREPARED.json").write_text(json.dumps({"asset_sha256": sha}))
    assert training_record(tmp_path)["train_minutes"] == json.loads((asset / "draft.json").read_text())["train_minutes"]
    assert len(training_record(tmp_path)["curve"]) == len(json.loads((asset / "curve.json").read_text()))
