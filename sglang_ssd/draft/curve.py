"""CurveZMQ for the draft channel: keys, and the socket options that turn it on.

The draft protocol itself has no authentication, so a non-loopback tcp endpoint is only allowed
with CurveZMQ (encryption + the draft accepting only known worker keys).  One key directory::

    DIR/server.key                  the draft's public key        (draft host and worker host)
    DIR/server.key_secret           the draft's secret key        (draft host only)
    DIR/client.key                  the worker's public key       (worker host)
    DIR/client.key_secret           the worker's secret key       (worker host only)
    DIR/authorized_clients/*.key    worker public keys the draft accepts (draft host)

``python -m sglang_ssd.draft.curve keygen DIR`` creates all of it (authorized_clients/ holds a copy of
client.key).  The draft reads the authorized keys once, at start: restart it after adding one.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import stat
import sys
from typing import Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized_clients"
ZAP_DOMAIN = "sglang-ssd"
KEYGEN_CMD = "python -m sglang_ssd.draft.curve keygen DIR"
# what each side reads from the key directory
NEEDS = {"server": (f"{SERVER}.key_secret", AUTHORIZED), "client": (f"{SERVER}.key", f"{CLIENT}.key_secret")}


class CurveKeyError(ValueError):
    """A missing or unreadable CurveZMQ key file; the message names the file and the keygen command."""


def keygen(key_dir: str, force: bool = False) -> dict[str, str]:
    """Create the server and client certificates in ``key_dir`` and authorize the client key.
    Refuses to overwrite existing keys unless ``force`` (a silent rotation would lock peers out)."""
    os.makedirs(key_dir, mode=0o700, exist_ok=True)
    existing = [n for n in (f"{SERVER}.key_secret", f"{CLIENT}.key_secret") if os.path.exists(os.path.join(key_dir, n))]
    if existing and not force:
        raise CurveKeyError(f"{key_dir} already holds {existing}; pass --force to replace the keys")
    auth_dir = os.path.join(key_dir, AUTHORIZED)
    os.makedirs(auth_dir, mode=0o700, exist_ok=True)
    out = {}
    for name in (SERVER, CLIENT):
        public, secret = zmq.auth.create_certificates(key_dir, name)
        os.chmod(secret, 0o600)
        out[f"{name}_public"], out[f"{name}_secret"] = public, secret
    out["authorized"] = shutil.copy(out["client_public"], os.path.join(auth_dir, f"{CLIENT}.key"))
    return out


def _load(path: str, secret: bool) -> tuple[bytes, Optional[bytes]]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CurveZMQ key {path}: {exc} (create keys with {KEYGEN_CMD})") from None
    if secret and not secret_key:
        raise CurveKeyError(f"{path} holds no secret key (create keys with {KEYGEN_CMD})")
    if secret and os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("CurveZMQ secret key %s is readable by other users; chmod 600 it", path)
    return public, secret_key


def check_key_dir(key_dir: str, role: str) -> None:
    """Raise CurveKeyError unless ``key_dir`` holds what the ``role`` ("server" = draft, "client" =
    worker) needs; reads the keys, so a damaged file fails here, at startup."""
    if not os.path.isdir(key_dir):
        raise CurveKeyError(f"CurveZMQ key directory {key_dir!r} does not exist (create it with {KEYGEN_CMD})")
    missing = [n for n in NEEDS[role] if not os.path.exists(os.path.join(key_dir, n))]
    if missing:
        raise CurveKeyError(f"CurveZMQ key directory {key_dir!r} lacks {missing} needed by the "
                            f"{'draft' if role == SERVER else 'worker'} (create keys with {KEYGEN_CMD})")
    if role == SERVER:
        server_keys(key_dir)
    else:
        client_keys(key_dir)


def server_keys(key_dir: str) -> tuple[bytes, bytes, dict[bytes, bool]]:
    """(server public, server secret, authorized client public keys) for the draft."""
    public, secret = _load(os.path.join(key_dir, f"{SERVER}.key_secret"), secret=True)
    auth_dir = os.path.join(key_dir, AUTHORIZED)
    try:
        authorized = zmq.auth.load_certificates(auth_dir)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read the authorized client keys in {auth_dir}: {exc}") from None
    if not authorized:
        raise CurveKeyError(f"{auth_dir} holds no *.key file: the draft would accept no worker "
                            f"(copy the worker's client.key there)")
    return public, secret, authorized  # type: ignore[return-value]


def client_keys(key_dir: str) -> tuple[bytes, bytes, bytes]:
    """(server public, client public, client secret) for the worker."""
    server_public, _ = _load(os.path.join(key_dir, f"{SERVER}.key"), secret=False)
    public, secret = _load(os.path.join(key_dir, f"{CLIENT}.key_secret"), secret=True)
    return server_public, public, secret  # type: ignore[return-value]


def configure_server(sock: zmq.Socket, ctx: zmq.Context, key_dir: str) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that admits only the authorized client keys; call before bind.
    Starts (and returns) the context's ZAP authenticator: the caller stops it when the socket closes.
    One authenticator per context, so a curve server wants a context of its own."""
    public, secret, authorized = server_keys(key_dir)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("sglang_ssd.draft.zap"))
    auth.start()
    try:
        auth.configure_curve(domain=ZAP_DOMAIN, location=os.path.join(key_dir, AUTHORIZED))
        if set(auth.certs.get(ZAP_DOMAIN, {})) != set(authorized):
            raise CurveKeyError(f"the ZAP authenticator did not load the keys in {key_dir}/{AUTHORIZED}")
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_server = True
    except BaseException:
        auth.stop()
        raise
    logger.info("CurveZMQ on: %d authorized worker key(s) from %s", len(authorized), key_dir)
    return auth


def configure_client(sock: zmq.Socket, key_dir: str) -> None:
    """Make ``sock`` a CURVE client of the draft whose public key is DIR/server.key; call before connect."""
    server_public, public, secret = client_keys(key_dir)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ssd.draft.curve",
                                 description="CurveZMQ keys for the draft channel (layout: this module's docstring)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    kg = sub.add_parser("keygen", help="create DIR/{server,client}.key[_secret] and DIR/authorized_clients/")
    kg.add_argument("dir")
    kg.add_argument("--force", action="store_true", help="replace existing keys")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(message)s")
    if not zmq.has("curve"):
        logger.error("this libzmq (%s) was built without CURVE support", zmq.zmq_version())
        return 2
    try:
        paths = keygen(args.dir, args.force)
    except CurveKeyError as exc:
        logger.error("%s", exc)
        return 2
    logger.info("created %s", ", ".join(sorted(paths.values())))
    logger.info("draft host needs server.key, server.key_secret, %s/; worker host needs server.key, client.key, "
                "client.key_secret (same host: the whole directory)", AUTHORIZED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
