"""The demo (`python -m sglang_ssd.demo`, what `bash scripts/demo.sh` ends with) on real servers of the tiny
synthetic pair: all three modes up together, taking turns prompt by prompt with the idle servers paused
(a process group in state T), greedy outputs identical across modes and passes, and the table printed."""

from __future__ import annotations

import os
import time

import pytest

from sglang_ssd import demo
from sglang_ssd.serving import SGLangServer


def _states(srv: SGLangServer) -> set[str]:
    """The scheduler-visible states (R, S, T, ...) of every process in the server's process group."""
    out = set()
    for pid in srv.group_pids():
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:  # exited since it was listed
            continue
        out.add(stat[stat.rindex(")") + 2])
    return out


def _stopped(srv: SGLangServer, wait_s: float = 3.0) -> bool:
    """Every process of the group in state T (SIGSTOP is delivered asynchronously: give it a moment)."""
    deadline = time.monotonic() + wait_s
    while _states(srv) != {"T"}:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.server
def test_demo_interleaves_modes_and_pauses_the_idle_servers(synthetic_pair, monkeypatch, capsys):
    target = f"{synthetic_pair}/target"
    if not os.path.exists(f"{target}/tokenizer.json"):
        pytest.skip("the synthetic pair has a tokenizer only where the SmolLM2 target is prepared")
    seen = []  # (mode served, states of the other servers' processes) at each request
    live: dict[str, SGLangServer] = {}
    real_start, real_generate = demo.start_server, SGLangServer.generate

    def start_server(mode, args, prompts, workdir, stack):
        live[mode] = srv = real_start(mode, args, prompts, workdir, stack)
        assert _stopped(srv), f"{mode} not paused after its warm-up: {_states(srv)}"
        return srv

    def generate(self, *a, **kw):
        if len(live) == 3:  # the measured requests (warm-ups run while the others start)
            mode = next(m for m, s in live.items() if s is self)
            seen.append((mode, [_states(s) for m, s in live.items() if s is not self]))
        return real_generate(self, *a, **kw)

    monkeypatch.setattr(demo, "start_server", start_server)
    monkeypatch.setattr(SGLangServer, "generate", generate)
    rc = demo.main(["--target", target, "--draft", f"{synthetic_pair}/draft_noisy", "--k", "2",
                    "--max-new-tokens", "6", "--passes", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy outputs identical across modes and passes: True" in out
    n = len(demo.PROMPTS)
    assert len(seen) == 3 * 2 * n
    assert all(others == [{"T"}, {"T"}] for _, others in seen), seen  # only the measured server runs
    order = [m for m, _ in seen]
    assert order[:6] == ["ar", "sd", "ssd", "ssd", "sd", "ar"]  # the order alternates prompt by prompt
    for name in ("AR (no speculation)", "SD (saguaro sync)", "SSD (saguaro async)"):
        row = next(line for line in out.splitlines() if line.startswith(name))
        assert float(row[22:30]) > 0, row  # tok/s
    ssd = next(line for line in out.splitlines() if line.startswith("SSD"))
    assert float(ssd[30:38].rstrip("x")) > 0 and ssd[38:42].strip() == "2", ssd  # vs AR, and K = 2
