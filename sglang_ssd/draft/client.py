"""DraftClient: the SGLang worker's handle on the draft process (DEALER socket, blocking calls).

Every request carries a fresh ``req_id``; a reply is accepted only if it echoes it, so a call that
timed out never desynchronises the socket (its late reply is discarded by the next call).
Not thread-safe: use one client per thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from typing import Callable, Optional, Sequence

import zmq

from sglang_ssd.draft.curve import configure_client
from sglang_ssd.draft.endpoint import check_endpoint
from sglang_ssd.protocol import (MAX_FRAME_BYTES, PROTOCOL_VERSION, Ack, ErrorReply, Health, HealthReply,
                                 Hello, HelloReply, Message, Prefill, ProtocolError, Release, Shutdown,
                                 Speculate, SpecReply, decode, peek_req_id)

logger = logging.getLogger(__name__)

ALIVE_POLL_MS = 200


class DraftTimeout(TimeoutError):
    """No reply with the request's id (``req_id``) arrived in time."""

    def __init__(self, message: str, req_id: Optional[int] = None):
        super().__init__(message)
        self.req_id = req_id


class DraftError(RuntimeError):
    """The draft rejected the request (ErrorReply); nothing was changed on its side."""

    def __init__(self, message: str, rids: Sequence[str] = ()):
        super().__init__(message)
        self.message, self.rids = message, list(rids)


class DraftUnsent(DraftError):
    """A request could not be handed to the socket in time (no connected draft): nothing was sent."""


class DraftClient:
    def __init__(self, endpoint: str, timeout_s: float = 60.0, context: Optional[zmq.Context] = None,
                 alive: Optional[Callable[[], bool]] = None, curve_keys: Optional[str] = None):
        """``alive``: optional liveness probe of the draft (e.g. its child process); while a reply is
        awaited it is checked every ``ALIVE_POLL_MS`` so a dead draft fails the call at once instead
        of at the timeout.  ``curve_keys``: a CurveZMQ key directory (sglang_ssd/draft/curve.py),
        required for a non-loopback tcp endpoint (InsecureEndpointError otherwise).  A draft that
        rejects the keys never answers: calls time out (DraftTimeout) or cannot be sent (DraftUnsent)."""
        check_endpoint(endpoint, curve=curve_keys is not None, action="connect")
        self.endpoint, self.timeout_s, self.alive = endpoint, timeout_s, alive
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
        try:
            if curve_keys is not None:
                configure_client(self.sock, curve_keys)
            self.sock.connect(endpoint)
        except BaseException:
            self.sock.close(0)
            raise
        # start ids at a random offset so a restarted client never reuses a live id
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") << 20)
        self.client_id = uuid.uuid4().hex
        self.discarded = 0

    # ---------------------------------------------------------------------------- low level
    def send(self, msg: Message, timeout_s: Optional[float] = None) -> int:
        """Queue ``msg`` with a fresh id.  A DEALER blocks a send when it has no pipe to queue on: after
        libzmq ended the session (a refused CurveZMQ handshake: it does not reconnect) or with the send
        high-water mark full.  Wait at most ``timeout_s`` for the socket to take it, then raise
        DraftUnsent (nothing was sent, no reply will come)."""
        msg.req_id = next(self._ids)
        frames = msg.encode()
        t = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return msg.req_id
            except zmq.Again:  # nothing of the message was queued
                pass
            if self.alive is not None and not self.alive():
                raise DraftError(f"the draft process behind {self.endpoint} is gone")
            left_ms = int((deadline - time.monotonic()) * 1e3)
            if left_ms <= 0:
                raise DraftUnsent(f"could not send request {msg.req_id} to {self.endpoint} within {t} s "
                                  "(no connected draft)")
            self.sock.poll(min(left_ms, ALIVE_POLL_MS), zmq.POLLOUT)

    def recv(self, req_id: int, timeout_s: Optional[float] = None) -> Message:
        """Wait for the reply to `req_id`; replies to other (timed-out) ids are discarded.
        ``timeout_s`` 0 polls once: a reply already received is returned, else DraftTimeout."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1e3))
            if not self.sock.poll(left_ms if self.alive is None else min(left_ms, ALIVE_POLL_MS)):
                if self.alive is not None and not self.alive():
                    raise DraftError(f"the draft process behind {self.endpoint} is gone")
                if left_ms <= 0:
                    raise DraftTimeout(f"no reply to request {req_id} from {self.endpoint} within "
                                       f"{self.timeout_s if timeout_s is None else timeout_s} s", req_id)
                continue
            frames = [f.buffer for f in self.sock.recv_multipart(copy=False)]
            try:
                msg = decode(frames)
            except ProtocolError:
                if peek_req_id(frames) == req_id:
                    raise
                self.discarded += 1
                logger.warning("discarded an undecodable reply not addressed to request %d", req_id)
                continue
            if msg.req_id == req_id:
                return msg
            self.discarded += 1
            logger.debug("discarded late %s for request %d (waiting for %d)", msg.TYPE, msg.req_id, req_id)

    def request(self, msg: Message, expect: type[Message], timeout_s: Optional[float] = None) -> Message:
        t = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        req_id = self.send(msg, t)  # send and reply share the call's timeout
        reply = self.recv(req_id, max(0.0, t - (time.monotonic() - t0)))
        if isinstance(reply, ErrorReply):
            raise DraftError(reply.message, reply.rids)
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected {expect.TYPE} in reply to {msg.TYPE}, got {reply.TYPE}")
        return reply

    # ------------------------------------------------------------------------------- calls
    def hello(self, k: int, mode: str, fan_out: Sequence[int], vocab_size: int,
              eos_ids: Sequence[int] = (), fan_out_miss: Optional[Sequence[int]] = None,
              client_id: Optional[str] = None, timeout_s: Optional[float] = None,
              backup: str = "neural", fan_out_auto: bool = False) -> HelloReply:
        msg = Hello(PROTOCOL_VERSION, client_id or self.client_id, k, mode, list(fan_out), vocab_size,
                    list(eos_ids), None if fan_out_miss is None else list(fan_out_miss), backup, fan_out_auto)
        return self.request(msg, HelloReply, timeout_s)

    def prefill(self, rids: Sequence[str], prompts: Sequence[Sequence[int]],
                temperatures: Sequence[float], timeout_s: Optional[float] = None,
                saguaro_c: Optional[Sequence[float]] = None) -> Ack:
        msg = Prefill(list(rids), [list(p) for p in prompts], [float(t) for t in temperatures],
                      [float(c) for c in saguaro_c] if saguaro_c is not None else [])
        return self.request(msg, Ack, timeout_s)

    def speculate(self, round_id: int, rids: Sequence[str], ks: Sequence[int], bonuses: Sequence[int],
                  temperatures: Sequence[float], timeout_s: Optional[float] = None,
                  features: Optional[tuple] = None, width: int = 0) -> SpecReply:
        """features: (feat_starts [n], feat_lens [n], rows [sum, F] float16) for an EAGLE-3 draft;
        width: the drafts per request the worker verifies (0 = K)."""
        extra = {} if features is None else dict(zip(("feat_starts", "feat_lens", "features"), features))
        msg = Speculate(round_id, list(rids), [int(k) for k in ks], [int(b) for b in bonuses],
                        [float(t) for t in temperatures], width=int(width), **extra)
        reply = self.request(msg, SpecReply, timeout_s)
        if reply.round_id != round_id or reply.tokens.shape[0] != len(rids):
            raise ProtocolError(f"reply to round {round_id} has round {reply.round_id} / "
                                f"{reply.tokens.shape[0]} rows for {len(rids)}")
        return reply

    def release(self, rids: Sequence[str], timeout_s: Optional[float] = None) -> Ack:
        return self.request(Release(list(rids)), Ack, timeout_s)

    def health(self, timeout_s: Optional[float] = None) -> dict[str, float]:
        return self.request(Health(), HealthReply, timeout_s).stats

    def shutdown(self, timeout_s: Optional[float] = None) -> Ack:
        return self.request(Shutdown(), Ack, timeout_s)

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(0)

    def __enter__(self) -> "DraftClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
