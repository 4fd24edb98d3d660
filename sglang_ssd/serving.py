"""Start, query and stop an SGLang HTTP server in a subprocess (used by the demo, tests, benchmarks)."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import requests

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_machine() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:
        return True


class SGLangServer:
    """``with SGLangServer(model, extra_args) as srv: srv.generate(...)``.

    On CPU it launches through ``sglang_ssd.launch_cpu``; on GPU through ``sglang.launch_server``.
    ``cpu_core`` pins the server's processes (taskset) - the draft it spawns pins itself elsewhere.
    """

    def __init__(self, model_path: str, extra_args: Optional[list[str]] = None, *,
                 env: Optional[dict] = None, cpu_core: Optional[int] = None,
                 startup_timeout: float = 300.0, log_path: Optional[str] = None, cwd: Optional[str] = None):
        self.model_path = model_path
        self.cwd = cwd  # `python -m` puts the working directory first on sys.path: a checkout there is imported
        self.extra_args = list(extra_args or [])
        self.env = dict(os.environ, **(env or {}))
        self.cpu_core = cpu_core
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    @staticmethod
    def launch_argv(model_path: str, port: int, extra_args: list[str]) -> list[str]:
        """The arguments the launcher module gets (scripts/gpu_plan.py parses exactly these)."""
        return ["--model-path", model_path, "--host", "127.0.0.1", "--port", str(port),
                "--skip-server-warmup", *extra_args]

    def start(self) -> "SGLangServer":
        module = "sglang_ssd.launch_cpu" if cpu_machine() else "sglang.launch_server"
        cmd = [sys.executable, "-m", module, *self.launch_argv(self.model_path, self.port, self.extra_args)]
        if self.cpu_core is not None:
            cmd = ["taskset", "-c", str(self.cpu_core)] + cmd
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        logger.info("starting: %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.cwd)
        try:
            return self._wait_healthy()
        except BaseException:  # a failed or interrupted start-up (SystemExit from a SIGTERM handler too)
            self.stop()        # must not leave the server's process group behind: __exit__ never runs
            raise

    def _wait_healthy(self) -> "SGLangServer":
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during startup"
                                   + (f"; log: {self.log_path}" if self.log_path else ""))
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {self.startup_timeout}s")

    def generate(self, text=None, input_ids=None, sampling_params: Optional[dict] = None,
                 timeout: float = 600, **extra) -> dict | list:
        payload = {"sampling_params": sampling_params or {}, **extra}
        if text is not None:
            payload["text"] = text
        if input_ids is not None:
            payload["input_ids"] = input_ids
        r = requests.post(self.url + "/generate", json=payload, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def server_info(self) -> dict:
        return requests.get(self.url + "/server_info", timeout=10).json()

    def huge_pages(self) -> dict[int, dict]:
        """Per process of the server's process group (launcher, scheduler, detokenizer, the draft it spawned):
        its GLIBC_TUNABLES and the kB of its anonymous memory on transparent huge pages (Linux /proc)."""
        out = {}
        for pid in self.group_pids():
            d = Path(f"/proc/{pid}")
            try:
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
                rollup = (d / "smaps_rollup").read_text()
                cmd = (d / "cmdline").read_text().replace("\0", " ").strip()
            except (OSError, ProcessLookupError, ValueError):
                continue
            thp = re.search(r"^AnonHugePages:\s+(\d+) kB", rollup, re.M)
            out[pid] = {"cmd": cmd[:120], "tunables": env.get("GLIBC_TUNABLES", ""),
                        "anon_huge_kb": int(thp.group(1)) if thp else 0}
        return out

    def group_pids(self) -> list[int]:
        """The live processes of the server's process group (launcher, scheduler, detokenizer, its draft)."""
        pids = []
        if self.proc is None:
            return pids
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.getpgid(int(d.name)) == self.proc.pid:
                    pids.append(int(d.name))
            except (OSError, ProcessLookupError):
                continue
        return pids

    def pause(self) -> None:
        """SIGSTOP the server's whole process group (launcher, scheduler, detokenizer and the draft it
        spawned): an idle SGLang scheduler spins at about half a core, so servers measured side by side
        take turns, the others paused."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def _signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self.resume()  # a paused process group would hold SIGTERM until it is continued
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
