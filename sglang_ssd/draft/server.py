"""DraftServer: single-threaded ROUTER loop  recv -> handle -> reply  (-> build the cache, async mode).

The cache build polls the socket between its steps (``_message_waiting``) and stops as soon as a
request is waiting, so the target never waits for a build; a Health probe is answered in passing
without cutting the build.

Robustness rules: undecodable frames, wrong versions and handler exceptions are logged and answered
with an ErrorReply (addressed to the request id when it can be read); the loop never dies on input.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Optional

import zmq
from zmq.auth.thread import ThreadAuthenticator

from sglang_ssd.draft import curve
from sglang_ssd.draft.endpoint import normalize_endpoint, remove_ipc_file
from sglang_ssd.draft.engine import DraftEngine, EngineError
from sglang_ssd.draft.runner import DraftRunner
from sglang_ssd.protocol import (MAX_FRAME_BYTES, Ack, ErrorReply, Health, HealthReply, Hello, Message,
                                 Prefill, ProtocolError, Release, Shutdown, Speculate, decode, peek_req_id)
from sglang_ssd.saguaro import datastore

FLUSH_WAIT_S = 0.005  # the most a cache build waits for the reply to leave (it takes ~0.1 ms)
# a Shutdown's Ack is the last reply: the socket closes with this linger, not 0, so a loaded machine's I/O thread
# still sends it (with 0 the Ack could be dropped and the worker waited its full timeout for it)
SHUTDOWN_LINGER_MS = 2000
logger = logging.getLogger(__name__)

# A draft serves ONE target: another target's Hello is refused while the owner has live requests and
# was heard from within this many seconds (after that the owner is presumed gone and may be replaced).
TAKEOVER_IDLE_S = 30.0


class DraftServer:
    def __init__(self, engine: DraftEngine, endpoint: str | None = None, context: Optional[zmq.Context] = None,
                 curve_keys: Optional[str] = None):
        """``curve_keys``: a CurveZMQ key directory (sglang_ssd/draft/curve.py); without one only ipc://
        and loopback tcp endpoints may be bound.  A curve server gets a zmq context of its own unless
        one is passed, since a context holds a single ZAP authenticator."""
        self.engine = engine
        endpoint = normalize_endpoint(endpoint, curve=curve_keys is not None)
        self._own_ctx = context is None and curve_keys is not None
        self.ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._close_linger_ms = 0  # SHUTDOWN_LINGER_MS once a Shutdown is answered
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
        self.sock.copy_threshold = 0  # every reply zero-copy: its tracker then says when the I/O thread took it
        self._unflushed: Optional[zmq.MessageTracker] = None  # the last reply sent, until _flush
        self.auth: Optional[ThreadAuthenticator] = None
        self.curve = curve_keys is not None
        self.endpoint = endpoint
        self._bound = False  # an ipc file is ours to remove only once we bound it
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.protocol_errors = 0
        self.handler_errors = 0
        self.refused_peers = 0
        self.owner_id: Optional[str] = None  # Hello.client_id of the target this draft serves
        self.owner_ident: Optional[bytes] = None  # its current ROUTER identity (new after a reconnect)
        self.owner_seen = 0.0
        self._stashed: Optional[list] = None  # frames received by a build's poll, handled next
        try:
            if curve_keys is not None:
                self.auth = curve.configure_server(self.sock, self.ctx, curve_keys)
            self.sock.bind(endpoint)
        except BaseException:
            self.close()
            raise
        self._bound = True
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @classmethod
    def from_model_dir(cls, model_dir: str, endpoint: str | None = None, device: str = "cpu",
                       dtype: str = "auto", seed: int = 0, max_batch: int = 1024,
                       curve_keys: Optional[str] = None, attention: str = "auto",
                       cuda_graphs: bool = True, target_dir: Optional[str] = None) -> "DraftServer":
        # endpoint and keys are checked before the (slow) model load, so a bad setting fails at once
        endpoint = normalize_endpoint(endpoint, curve=curve_keys is not None)
        if curve_keys is not None:
            curve.check_key_dir(curve_keys, curve.SERVER)
        runner = DraftRunner.from_dir(model_dir, device, dtype, attention, cuda_graphs, target_dir)
        corpus = datastore.load_for(model_dir)  # a draft shipped with a datastore (saguaro/datastore.py)
        if corpus is not None:
            logger.info("datastore: %d continuations of %s-grams", len(corpus), "/".join(map(str, corpus.ns)))
        return cls(DraftEngine(runner, seed, max_batch, corpus=corpus), endpoint,
                   curve_keys=curve_keys)

    # ---------------------------------------------------------------------------------- loop
    def serve_forever(self, poll_ms: int = 100) -> None:
        logger.info("draft server listening on %s (%s)", self.endpoint,
                    "CurveZMQ: authorized workers only" if self.curve else "no authentication: loopback / ipc")
        try:
            while not self._stop.is_set():
                frames, self._stashed = self._stashed, None
                if frames is None:
                    if not self.sock.poll(poll_ms):
                        continue
                    frames = self.sock.recv_multipart(copy=False)
                if not self._handle_frames(frames):
                    break
        finally:
            self.close()
            logger.info("draft server on %s stopped", self.endpoint)

    def close(self) -> None:
        """Close the socket, stop the ZAP authenticator with it, and free what this server owns.
        Idempotent; call from the thread that serves (or when it never served)."""
        if not self.sock.closed:
            self.sock.close(self._close_linger_ms)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()
        if self._bound:
            remove_ipc_file(self.endpoint)

    def _handle_frames(self, frames: list) -> bool:
        """-> False when the loop must stop (Shutdown)."""
        ident, body = frames[0].bytes, [f.buffer for f in frames[1:]]
        try:
            msg = decode(body)
        except ProtocolError as exc:
            self.protocol_errors += 1
            req_id = peek_req_id(body)
            logger.warning("rejected malformed message (req_id %s): %s", req_id, exc)
            self._send(ident, ErrorReply(message=f"protocol error: {exc}"[:60000], req_id=req_id or 0))
            return True
        t0 = time.perf_counter()
        try:
            self._admit(ident, msg)
            reply = self._dispatch(msg)
            if isinstance(msg, Hello):
                self.owner_id, self.owner_ident = msg.client_id, ident
            if ident == self.owner_ident:
                self.owner_seen = time.monotonic()
        except EngineError as exc:
            logger.warning("rejected %s (req_id %d): %s", msg.TYPE, msg.req_id, exc.message)
            reply = ErrorReply(message=exc.message[:60000], rids=exc.rids, req_id=msg.req_id)
        except Exception as exc:  # a handler bug must not kill the draft process
            self.handler_errors += 1
            logger.exception("error while handling %s (req_id %d)", msg.TYPE, msg.req_id)
            self._reset_after_failure(msg)
            reply = ErrorReply(message=f"internal error: {type(exc).__name__}: {exc}"[:60000],
                               rids=getattr(msg, "rids", []), req_id=msg.req_id)
        reply.req_id = msg.req_id
        self._send(ident, reply)
        logger.debug("%s handled in %.2f ms", msg.TYPE, (time.perf_counter() - t0) * 1e3)
        if isinstance(msg, Shutdown) and not isinstance(reply, ErrorReply):
            self._close_linger_ms = SHUTDOWN_LINGER_MS  # the Ack leaves before the socket is gone
            return False
        if self.engine.pending:  # ANSWER FIRST, then build the next round's cache (until a message waits)
            self._flush()
            try:
                self.engine.build_cache(self._message_waiting)
            except Exception:
                self.handler_errors += 1
                logger.exception("cache build failed; next round will miss")
                self.engine.cache.clear()
        return True

    def _message_waiting(self) -> bool:
        """The build's should_stop: True once a message is waiting (it is kept and handled next).
        Health probes are answered here and do not stop the build."""
        while self._stashed is None and not self._stop.is_set() and self.sock.poll(0, zmq.POLLIN):
            frames = self.sock.recv_multipart(copy=False)
            try:
                is_health = isinstance(decode([f.buffer for f in frames[1:]]), Health)
            except ProtocolError:
                is_health = False
            if not is_health:
                self._stashed = frames
                break
            self._handle_frames(frames)  # engine.pending is empty during a build: no nested build
        return self._stashed is not None or self._stop.is_set()

    def _admit(self, ident: bytes, msg: Message) -> None:
        """Isolation between targets: only the session owner (the client_id of the accepted Hello, at
        the identity it last said Hello from) may prefill / speculate / release / shut down; a second
        target's Hello is refused while the owner is active.  Health is open to any local peer."""
        if isinstance(msg, Health) or ident == self.owner_ident:
            return
        active = bool(self.engine.requests) and time.monotonic() - self.owner_seen < TAKEOVER_IDLE_S
        if isinstance(msg, Hello):
            if self.owner_id is None or msg.client_id == self.owner_id or not active:
                return
            why = (f"this draft serves another target (client {self.owner_id[:12]}, {len(self.engine.requests)} "
                   f"live requests); one draft process serves one target: start another draft process")
        elif isinstance(msg, Shutdown) and not active:
            return
        else:
            why = f"{msg.TYPE} from a peer that is not this draft's session owner (send Hello first)"
        self.refused_peers += 1
        raise EngineError(why, getattr(msg, "rids", []))

    def _dispatch(self, msg: Message) -> Message:
        e = self.engine
        if isinstance(msg, Speculate):
            return e.speculate(msg)
        if isinstance(msg, Hello):
            return e.hello(msg)
        if isinstance(msg, Prefill):
            return e.prefill(msg)
        if isinstance(msg, Release):
            return e.release(msg)
        if isinstance(msg, Health):
            stats = e.health()
            stats.update(e.runner.health())  # attention backend, FlashInfer fallback, CUDA graphs
            stats.update(protocol_errors=self.protocol_errors, handler_errors=self.handler_errors,
                         refused_peers=self.refused_peers,
                         sglang_imported=int(any(m == "sglang" or m.startswith("sglang.") for m in sys.modules)))
            return HealthReply(stats=stats)
        if isinstance(msg, Shutdown):
            logger.info("shutdown requested")
            return Ack(message="bye")
        raise EngineError(f"{msg.TYPE} is not a request")

    def _reset_after_failure(self, msg: Message) -> None:
        """An exception mid-handler may leave a request half-updated: drop the rows it touched."""
        self.engine.pending = []
        for rid in getattr(msg, "rids", []):
            if isinstance(msg, (Speculate, Prefill)):
                self.engine.requests.pop(rid, None)
                self.engine.cache.drop(rid)

    def _send(self, ident: bytes, msg: Message) -> None:
        try:
            self._unflushed = self.sock.send_multipart([ident, *msg.encode()], copy=False, track=True)
        except (ProtocolError, zmq.ZMQError) as exc:
            logger.error("could not send %s: %s", msg.TYPE, exc)

    def _flush(self) -> None:
        """Wait (at most FLUSH_WAIT_S) until ZeroMQ's I/O thread has taken the reply just sent.  send only
        queues it for that thread, which shares this process's core: a cache build started at once kept it
        off the core for 2-5 ms per round on a CPU draft pinned to one core, the target waiting that long for
        a reply that was ready (results/variants_headline_flush_zen5.md)."""
        tracker, self._unflushed = self._unflushed, None
        if tracker is not None and not tracker.done:
            try:
                tracker.wait(FLUSH_WAIT_S)
            except zmq.NotDone:
                logger.debug("reply not taken by the I/O thread within %.1f ms; building anyway", FLUSH_WAIT_S * 1e3)

    # ----------------------------------------------------------------------------- threading
    def start_in_thread(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.serve_forever, name="sglang-ssd-draft", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:  # never served: nothing else will close the socket and the authenticator
            self.close()
