"""An SGLang frontend program (sgl.function with gen, and a multi-turn chat) runs unchanged against the
saguaro server and, at temperature 0, produces exactly what it produces against a plain server."""

import json
import sys
import uuid
from pathlib import Path

import pytest

from sglang_ssd.serving import SGLangServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from frontend_program import run_programs  # noqa: E402

pytestmark = pytest.mark.server
COMMON = ["--dtype", "float32", "--max-running-requests", "4"]


def test_frontend_program_same_as_plain_server(target_path, draft_path, tmp_path):
    with SGLangServer(target_path, COMMON, cpu_core=0, log_path=str(tmp_path / "ar.log")) as srv:
        plain = run_programs(srv.url)
    stats = tmp_path / "stats.json"
    cfg = {"mode": "async", "fan_out": 2, "stats_file": str(stats),
           "draft_endpoint": f"ipc://{tmp_path}/draft-{uuid.uuid4().hex[:6]}.sock"}
    with SGLangServer(target_path, COMMON + ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path",
                                             draft_path, "--speculative-num-steps", "3"],
                      env={"SGLANG_SSD_CONFIG": json.dumps(cfg)}, cpu_core=0,
                      log_path=str(tmp_path / "saguaro.log")) as srv:
        spec = run_programs(srv.url)
    st = json.loads(stats.read_text())
    # every slot generated something, and the chat went through the chat template
    assert all(plain[k].strip() for k in ("tip1", "tip2", "answer1", "answer2")), plain
    assert plain["chat_text"].count("<|im_start|>assistant") == 2
    assert spec == plain
    # the saguaro server really speculated (verified rounds, accepted drafts), without errors
    assert st["rounds"] > 0 and st["accept_len"] > 1.0 and st["errors"] == 0, st
