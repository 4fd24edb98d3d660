"""ZeroMQ endpoint strings: ipc by default, tcp on loopback; anything else only with CurveZMQ keys.

The draft protocol has no authentication of its own: a peer that can reach the socket can drive the
draft (and read what it proposes).  So binding or connecting a tcp address that is not loopback is
refused unless CurveZMQ is configured (sglang_ssd/draft/curve.py).
"""

from __future__ import annotations

import ipaddress
import os
import uuid


class InsecureEndpointError(ValueError):
    """A non-loopback tcp endpoint without CurveZMQ keys."""


def _is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a host name or interface name: cannot tell where it leads, so not loopback
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def is_loopback(endpoint: str) -> bool:
    """True for ipc:// / inproc:// and tcp:// whose every host (source;destination) is 127.0.0.0/8, ::1
    or localhost."""
    if not endpoint.startswith("tcp://"):
        return endpoint.startswith(("ipc://", "inproc://"))
    return all(_is_loopback_host(part.rsplit(":", 1)[0]) for part in endpoint[len("tcp://"):].split(";"))


def check_endpoint(endpoint: str, curve: bool, action: str = "bind") -> None:
    """Refuse (InsecureEndpointError) a non-loopback endpoint unless CurveZMQ keys are configured."""
    if curve or is_loopback(endpoint):
        return
    raise InsecureEndpointError(
        f"refusing to {action} the draft endpoint {endpoint!r}: it is not loopback (127.0.0.0/8, ::1, "
        "localhost) and the draft protocol has no authentication of its own. Use ipc:// or "
        "tcp://127.0.0.1:PORT, or configure CurveZMQ: create keys with `python -m sglang_ssd.draft.curve "
        "keygen DIR`, start the draft with --curve-keys DIR and give the worker SGLANG_SSD_CONFIG "
        '{"curve_keys": "DIR"} (or DraftClient(..., curve_keys=DIR))')


def default_endpoint() -> str:
    """A fresh private ipc socket path: ipc:///tmp/sglang-ssd-<uuid>.sock."""
    return f"ipc:///tmp/sglang-ssd-{uuid.uuid4().hex}.sock"


def normalize_endpoint(spec: str | None, curve: bool = False) -> str:
    """'' / None / 'ipc' -> a fresh ipc path; 'tcp' -> tcp://127.0.0.1:* (random port, bind side);
    'tcp:PORT' or 'tcp://:PORT' -> tcp://127.0.0.1:PORT; full ipc:// / tcp:// strings pass through,
    non-loopback tcp only with ``curve`` (else InsecureEndpointError)."""
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
    check_endpoint(spec, curve, "bind")
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
