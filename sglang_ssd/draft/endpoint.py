"""ZeroMQ endpoint strings: ipc by default, tcp on loopback unless explicitly told otherwise."""

from __future__ import annotations

import logging
import os
import uuid

logger = logging.getLogger(__name__)


def default_endpoint() -> str:
    """A fresh private ipc socket path: ipc:///tmp/sglang-ssd-<uuid>.sock."""
    return f"ipc:///tmp/sglang-ssd-{uuid.uuid4().hex}.sock"


def normalize_endpoint(spec: str | None) -> str:
    """'' / None / 'ipc' -> a fresh ipc path; 'tcp' -> tcp://127.0.0.1:* (random port, bind side);
    'tcp:PORT' or 'tcp://:PORT' -> tcp://127.0.0.1:PORT; full ipc:// / tcp:// strings pass through."""
    if not spec or spec == "ipc":
        return default_endpoint()
    if spec == "tcp":
        return "tcp://127.0.0.1:*"
    if spec.startswith("tcp:") and not spec.startswith("tcp://"):
        return f"tcp://127.0.0.1:{spec[4:]}"
    if spec.startswith("tcp://:"):
        return f"tcp://127.0.0.1{spec[6:]}"
    if not spec.startswith(("ipc://", "tcp://")):
        raise ValueError(f"endpoint {spec!r} must be ipc://PATH or tcp://HOST:PORT")
    host = spec[6:].rsplit(":", 1)[0] if spec.startswith("tcp://") else ""
    if host in ("*", "0.0.0.0", "[::]", "::"):
        logger.warning("draft endpoint %s listens on every interface; the protocol has no authentication", spec)
    return spec


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def remove_ipc_file(endpoint: str) -> None:
    path = ipc_path(endpoint)
    if path and os.path.exists(path):
        try:
            os.unlink(path)
        except OSError:
            pass
