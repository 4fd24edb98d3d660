"""Wire format between the SGLang worker and the SSD draft process (the ONLY module that knows it).

A message is one ZeroMQ multipart message (after the ROUTER identity frame, if any):

    frame 0      msgpack map  {"magic": "sglang-ssd", "version": 1, "type": <name>, "req_id": <int>,
                               "fields": {<scalar / list fields>},
                               "arrays": [[<name>, <dtype str>, <shape list>], ...]}
    frame 1..n   raw little-endian C-order buffers of the declared arrays, in declaration order

Never pickle.  ``decode`` checks magic, version, message type, the exact field set and field types,
each array's dtype / rank against the message schema, ``prod(shape) * itemsize == len(buffer)``,
frame counts and size limits; any violation raises ``ProtocolError`` (both ends log and reject).
``req_id`` pairs a reply with its request so a DEALER whose call timed out can discard late replies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence, Union

import msgpack
import numpy as np

MAGIC = "sglang-ssd"
PROTOCOL_VERSION = 7  # 2: Prefill carries per-request Saguaro sampling C; Hello the backup kind
                      # 3: HelloReply says whether the session was resumed (state kept)
                      # 4: Prefill.round0: build a round-0 cache (sent while the target prefills)
                      # 5: SpecReply.q_ids: q travels over the draft head's token ids only
                      # 6: SpecReply.builds / cut_depth / fast_rows (for the worker's metrics)
                      # 7: backup "hybrid" (one neural draft step, then n-gram; counted in fast_rows)
BACKUPS = ("neural", "fast", "hybrid", "auto")
MAX_HEADER_BYTES = 4 << 20        # msgpack header frame
MAX_FRAME_BYTES = 1 << 30         # any array frame (q of a large batch is the big one)
MAX_BATCH = 4096                  # rows per Prefill / Speculate / Release
MAX_K = 64                        # drafts per round
MAX_FAN_OUT = 1024                # branches forked at one glue index
MAX_VOCAB = 1 << 22
MAX_PROMPT_TOKENS = 1 << 24       # total tokens in one Prefill
MAX_STR = 512                     # rids, client ids, names
MAX_MESSAGE_STR = 1 << 16         # error messages
MODES = ("async", "sync")

Buffer = Union[bytes, bytearray, memoryview]
Frames = list  # list[bytes | memoryview]; zmq sends either without copying


class ProtocolError(ValueError):
    """Malformed, oversized, wrong-version or otherwise invalid frames."""


# ---------------------------------------------------------------------------------------------
# field checkers: each returns the (normalised) value or raises ProtocolError naming the field
# ---------------------------------------------------------------------------------------------
def _fail(name: str, why: str) -> ProtocolError:
    return ProtocolError(f"field {name!r}: {why}")


def _int(v: Any, name: str, lo: int = -(1 << 62), hi: int = 1 << 62) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise _fail(name, f"expected int, got {type(v).__name__}")
    if not lo <= int(v) <= hi:
        raise _fail(name, f"{int(v)} outside [{lo}, {hi}]")
    return int(v)


def _float(v: Any, name: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise _fail(name, f"expected number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise _fail(name, f"{f} not finite or outside [{lo}, {hi}]")
    return f


def _str(v: Any, name: str, max_len: Optional[int] = None) -> str:
    if not isinstance(v, str):
        raise _fail(name, f"expected str, got {type(v).__name__}")
    max_len = MAX_STR if max_len is None else max_len
    if len(v) > max_len:
        raise _fail(name, f"string longer than {max_len}")
    return v


def _list(v: Any, name: str, max_len: int) -> list:
    if isinstance(v, np.ndarray) and v.ndim == 1:  # a decoded array standing in for a list
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise _fail(name, f"expected list, got {type(v).__name__}")
    if len(v) > max_len:
        raise _fail(name, f"list longer than {max_len}")
    return list(v)


def _int_list(v: Any, name: str, max_len: int, lo: int, hi: int) -> list[int]:
    return [_int(x, f"{name}[{i}]", lo, hi) for i, x in enumerate(_list(v, name, max_len))]


def _str_list(v: Any, name: str, unique: bool = True) -> list[str]:
    out = [_str(x, f"{name}[{i}]") for i, x in enumerate(_list(v, name, MAX_BATCH))]
    if unique and len(set(out)) != len(out):
        raise _fail(name, "duplicate entries")
    return out


def _float_list(v: Any, name: str) -> list[float]:
    return [_float(x, f"{name}[{i}]", 0.0, 1e6) for i, x in enumerate(_list(v, name, MAX_BATCH))]


def _stats(v: Any, name: str) -> dict[str, float]:
    if not isinstance(v, dict) or len(v) > 1024:
        raise _fail(name, "expected a dict of at most 1024 entries")
    out = {}
    for key, val in v.items():
        key = _str(key, f"{name} key")
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            raise _fail(f"{name}[{key}]", f"expected number, got {type(val).__name__}")
        out[key] = val
    return out


def _same_len(name: str, n: int, **lists: Sequence) -> None:
    for key, seq in lists.items():
        if len(seq) != n:
            raise _fail(key, f"length {len(seq)} != len({name}) = {n}")


# ---------------------------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Message:
    """Base class.  A subclass names its msgpack header fields (HEADER) and its arrays
    (ARRAYS = {name: (dtype, ndim)}); attributes of the same names are (de)serialised, then
    ``validate`` type-checks and normalises them (lists of ints, numpy arrays...)."""

    TYPE: ClassVar[str] = ""
    HEADER: ClassVar[tuple[str, ...]] = ()
    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {}
    req_id: int = 0

    def _fields(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self.HEADER}

    def _arrays(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self.ARRAYS}

    @classmethod
    def _build(cls, f: dict[str, Any], a: dict[str, np.ndarray], req_id: int) -> "Message":
        missing, extra = [n for n in cls.HEADER if n not in f], sorted(set(f) - set(cls.HEADER))
        if missing or extra:
            raise ProtocolError(f"{cls.TYPE}: missing fields {missing}, unexpected fields {extra}")
        return cls(**f, **a, req_id=req_id)

    def validate(self) -> None:
        """Semantic checks shared by encode and decode; raise ProtocolError."""

    # --- generic framing ---------------------------------------------------------------
    def encode(self) -> Frames:
        """-> [msgpack header, array buffers...] (bytes / zero-copy memoryviews)."""
        self.validate()
        arrays = self._arrays()
        specs, bufs = [], []
        for name, (dtype, ndim) in self.ARRAYS.items():
            arr = np.ascontiguousarray(arrays[name], dtype=np.dtype(dtype))
            if arr.ndim != ndim:
                raise ProtocolError(f"{self.TYPE}.{name}: rank {arr.ndim} != {ndim}")
            if arr.nbytes > MAX_FRAME_BYTES:
                raise ProtocolError(f"{self.TYPE}.{name}: {arr.nbytes} bytes > MAX_FRAME_BYTES")
            specs.append([name, dtype, list(arr.shape)])
            bufs.append(memoryview(arr.reshape(-1).view(np.uint8)))
        header = msgpack.packb({"magic": MAGIC, "version": PROTOCOL_VERSION, "type": self.TYPE,
                                "req_id": _int(self.req_id, "req_id", 0, 1 << 62),
                                "fields": self._fields(), "arrays": specs}, use_bin_type=True)
        if len(header) > MAX_HEADER_BYTES:
            raise ProtocolError(f"{self.TYPE}: header of {len(header)} bytes > MAX_HEADER_BYTES")
        return [header, *bufs]

    @classmethod
    def decode(cls, frames: Sequence[Buffer]) -> "Message":
        """Decode frames that must hold a message of exactly this class (Message: any class)."""
        msg = decode(frames)
        if cls is not Message and type(msg) is not cls:
            raise ProtocolError(f"expected {cls.TYPE}, got {msg.TYPE}")
        return msg

def _header(frames: Sequence[Buffer]) -> dict:
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("no frames")
    head = frames[0]
    if not isinstance(head, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame 0 is {type(head).__name__}, not a buffer")
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {len(head)} bytes > MAX_HEADER_BYTES")
    try:
        h = msgpack.unpackb(bytes(head), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(h, dict):
        raise ProtocolError("header is not a map")
    if h.get("magic") != MAGIC:
        raise ProtocolError(f"bad magic {h.get('magic')!r}")
    return h


def peek_req_id(frames: Sequence[Buffer]) -> Optional[int]:
    """Best-effort request id of possibly-invalid frames (to address an ErrorReply); None if unknown."""
    try:
        rid = _header(frames).get("req_id")
    except ProtocolError:
        return None
    return int(rid) if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= 1 << 62 else None


def decode(frames: Sequence[Buffer]) -> Message:
    """frames (without any ROUTER identity) -> Message; raises ProtocolError on anything invalid."""
    h = _header(frames)
    if h.get("version") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {h.get('version')!r} (this end speaks "
                            f"{PROTOCOL_VERSION})")
    if set(h) != {"magic", "version", "type", "req_id", "fields", "arrays"}:
        raise ProtocolError(f"header keys {sorted(h)} are not the expected set")
    cls = MESSAGE_TYPES.get(h["type"]) if isinstance(h["type"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {h['type']!r}")
    req_id = _int(h["req_id"], "req_id", 0, 1 << 62)
    if not isinstance(h["fields"], dict):
        raise ProtocolError("'fields' is not a map")
    specs = _list(h["arrays"], "arrays", 64)
    if [s[0] if isinstance(s, list) and s else None for s in specs] != list(cls.ARRAYS):
        raise ProtocolError(f"{cls.TYPE}: declared arrays do not match schema {list(cls.ARRAYS)}")
    if len(frames) != 1 + len(specs):
        raise ProtocolError(f"{cls.TYPE}: {len(frames)} frames for {len(specs)} arrays")
    arrays = {}
    for spec, buf in zip(specs, frames[1:]):
        name, want_dtype, want_ndim = spec[0], *cls.ARRAYS[spec[0]]
        if len(spec) != 3 or spec[1] != want_dtype:
            raise ProtocolError(f"{cls.TYPE}.{name}: dtype {spec[1:2]} != {want_dtype}")
        shape = _int_list(spec[2], f"{name}.shape", 8, 0, MAX_FRAME_BYTES)
        if len(shape) != want_ndim:
            raise ProtocolError(f"{cls.TYPE}.{name}: rank {len(shape)} != {want_ndim}")
        if not isinstance(buf, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"{cls.TYPE}.{name}: frame is {type(buf).__name__}, not a buffer")
        nbytes = math.prod(shape) * np.dtype(want_dtype).itemsize
        if nbytes > MAX_FRAME_BYTES or len(buf) != nbytes:
            raise ProtocolError(f"{cls.TYPE}.{name}: shape {shape} needs {nbytes} bytes, frame has {len(buf)}")
        # copy: the result is writable and independent of zmq's frame memory
        arrays[name] = np.frombuffer(buf, dtype=np.dtype(want_dtype)).reshape(shape).copy()
    msg = cls._build(dict(h["fields"]), arrays, req_id)
    msg.validate()
    return msg



@dataclass
class Hello(Message):
    """Session setup: the worker's config.  A new client_id (or a changed config) resets the draft;
    the same client repeating its session's original Hello (``same_session``) resumes it."""

    TYPE: ClassVar[str] = "hello"
    HEADER: ClassVar = ("version", "client_id", "k", "mode", "fan_out", "vocab_size", "eos_ids", "fan_out_miss",
                        "backup", "fan_out_auto")
    version: int
    client_id: str
    k: int
    mode: str
    fan_out: list[int]
    vocab_size: int
    eos_ids: list[int] = field(default_factory=list)
    fan_out_miss: Optional[list[int]] = None  # fan-out after a backup-drafted round (default fan_out)
    backup: str = "neural"                     # backup speculator for cache misses: neural | fast | auto
    fan_out_auto: bool = False                 # re-plan fan-outs online (Theorem 12), same budget

    def validate(self):
        self.version = _int(self.version, "version", 0, 1 << 30)
        self.client_id = _str(self.client_id, "client_id")
        self.k = _int(self.k, "k", 1, MAX_K)
        if _str(self.mode, "mode") not in MODES:
            raise _fail("mode", f"must be one of {MODES}, got {self.mode!r}")
        for name in ("fan_out", "fan_out_miss"):
            if name == "fan_out" or self.fan_out_miss is not None:
                fan = _int_list(getattr(self, name), name, MAX_K + 1, 0, MAX_FAN_OUT)
                if len(fan) != self.k + 1:
                    raise _fail(name, f"needs K+1 = {self.k + 1} entries, got {len(fan)}")
                setattr(self, name, fan)
        self.vocab_size = _int(self.vocab_size, "vocab_size", 1, MAX_VOCAB)
        self.eos_ids = _int_list(self.eos_ids, "eos_ids", 64, 0, self.vocab_size - 1)
        if not isinstance(self.fan_out_auto, bool):
            raise _fail("fan_out_auto", "must be a bool")
        if _str(self.backup, "backup") not in BACKUPS:
            raise _fail("backup", f"must be one of {BACKUPS}, got {self.backup!r}")

    def same_session(self, other: "Hello") -> bool:
        """Same client and every configuration field as sent (fan-outs as requested, not as re-fitted)."""
        return self._fields() == other._fields()


@dataclass
class HelloReply(Message):
    """``resumed``: the draft kept the session's requests, KV and cache (the same client repeated its
    session's Hello); False = a fresh session, the worker must re-prefill its live requests."""

    TYPE: ClassVar[str] = "hello_reply"
    HEADER: ClassVar = ("version", "draft_vocab_size", "draft_model_name", "pid", "device", "dtype", "max_batch",
                        "resumed")
    version: int
    draft_vocab_size: int
    draft_model_name: str
    pid: int
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = MAX_BATCH
    resumed: bool = False

    def validate(self):
        self.version = _int(self.version, "version", 0, 1 << 30)
        self.draft_vocab_size = _int(self.draft_vocab_size, "draft_vocab_size", 1, MAX_VOCAB)
        self.draft_model_name = _str(self.draft_model_name, "draft_model_name", 4096)
        self.pid = _int(self.pid, "pid", 0, 1 << 40)
        self.device, self.dtype = _str(self.device, "device"), _str(self.dtype, "dtype")
        self.max_batch = _int(self.max_batch, "max_batch", 1, 1 << 20)
        if not isinstance(self.resumed, bool):
            raise _fail("resumed", "must be a bool")


@dataclass
class Prefill(Message):
    """Start requests: the draft computes KV for every prompt token.  Prompts travel as one int64
    array plus lengths; an existing rid is replaced.  saguaro_c: per request Saguaro sampling C in
    (0, 1] (1 = plain sampling; empty = all 1).  round0: the target is prefilling these prompts now
    (the worker sent this before its own prefill), so in async mode the draft pre-computes the first
    round's speculations for its top guesses of the first sampled token; a prefilled request counts as
    having proposed an empty speculation (its first outcome is k = 0 with that token as the bonus)."""

    TYPE: ClassVar[str] = "prefill"
    HEADER: ClassVar = ("rids", "round0")
    ARRAYS: ClassVar = {"tokens": ("<i8", 1), "lens": ("<i8", 1), "temperatures": ("<f8", 1),
                        "saguaro_c": ("<f8", 1)}
    rids: list[str]
    prompts: list[list[int]]
    temperatures: list[float]
    saguaro_c: list[float] = field(default_factory=list)
    round0: bool = False

    def _arrays(self):
        return {"tokens": np.asarray([t for p in self.prompts for t in p], dtype=np.int64).reshape(-1),
                "lens": np.asarray([len(p) for p in self.prompts], dtype=np.int64).reshape(-1),
                "temperatures": np.asarray(self.temperatures, dtype=np.float64).reshape(-1),
                "saguaro_c": np.asarray(self.saguaro_c, dtype=np.float64).reshape(-1)}

    @classmethod
    def _build(cls, f, a, req_id):
        lens, tokens = a.pop("lens"), a.pop("tokens")
        if (lens < 1).any() or int(lens.sum()) != len(tokens):
            raise ProtocolError("prefill: prompt lengths do not add up to the token buffer")
        a["prompts"] = [p.tolist() for p in np.split(tokens, np.cumsum(lens)[:-1])] if len(lens) else []
        return super()._build(f, a, req_id)

    def validate(self):
        self.rids = _str_list(self.rids, "rids")
        _same_len("rids", len(self.rids), prompts=self.prompts, temperatures=self.temperatures)
        total = 0
        for i, p in enumerate(self.prompts):
            if len(p) < 1:
                raise _fail(f"prompts[{i}]", "empty prompt")
            total += len(p)
            if total > MAX_PROMPT_TOKENS:
                raise _fail("prompts", f"more than {MAX_PROMPT_TOKENS} tokens in one Prefill")
            if min(p) < 0 or max(p) >= MAX_VOCAB:
                raise _fail(f"prompts[{i}]", "token id out of range")
        self.temperatures = _float_list(self.temperatures, "temperatures")
        if len(self.saguaro_c) == 0:
            self.saguaro_c = [1.0] * len(self.rids)
        _same_len("rids", len(self.rids), saguaro_c=self.saguaro_c)
        self.saguaro_c = _float_list(self.saguaro_c, "saguaro_c")
        if any(not 0.0 < c <= 1.0 for c in self.saguaro_c):
            raise _fail("saguaro_c", "every C must be in (0, 1]")
        if not isinstance(self.round0, bool):
            raise _fail("round0", "must be a bool")


@dataclass
class Speculate(Message):
    """One decode round.  Row i: rid ``rids[i]`` accepted ``ks[i]`` tokens of the last speculation
    (-1: there was none) followed by ``bonuses[i]``; reply with K drafts after that new context."""

    TYPE: ClassVar[str] = "speculate"
    HEADER: ClassVar = ("round_id", "rids")
    ARRAYS: ClassVar = {"ks": ("<i8", 1), "bonuses": ("<i8", 1), "temperatures": ("<f8", 1)}
    round_id: int
    rids: list[str]
    ks: list[int]
    bonuses: list[int]
    temperatures: list[float]

    def validate(self):
        self.round_id = _int(self.round_id, "round_id", 0, 1 << 62)
        self.rids = _str_list(self.rids, "rids")
        _same_len("rids", len(self.rids), ks=self.ks, bonuses=self.bonuses, temperatures=self.temperatures)
        self.ks = _int_list(self.ks, "ks", MAX_BATCH, -1, MAX_K)
        self.bonuses = _int_list(self.bonuses, "bonuses", MAX_BATCH, 0, MAX_VOCAB - 1)
        self.temperatures = _float_list(self.temperatures, "temperatures")


@dataclass
class SpecReply(Message):
    """tokens [n, K] int64; hit [n] bool; q [m, K, W] float16 = the wire image of the proposal each
    token was drawn from, for rows ``q_rows`` (sorted, = the rows with temperature > 0), over the
    token ids ``q_ids`` (strictly increasing, W of them; q is exactly 0 at every other id): a reduced
    draft head's ids, sent once per reply; empty = the full vocabulary (W = V, q dense).
    The verifier must use ``dequantize_proposal(q)``: that is bit-identical to what the draft
    sampled from.  Timings in milliseconds, measured inside the draft process.

    A row may be SHORT: d < K usable tokens followed by K - d entries of -1 (a cache entry whose build
    was cut after depth d, so the target is never kept waiting for it).  The verifier may accept at
    most d drafts of it; the q rows of the padded positions are zeros and never used."""

    TYPE: ClassVar[str] = "spec_reply"
    TIMINGS: ClassVar = ("answer_ms", "backup_ms", "build_ms", "glue_ms", "tree_ms")
    COUNTS: ClassVar = ("builds", "cut_depth", "fast_rows")
    HEADER: ClassVar = ("round_id",) + TIMINGS + COUNTS
    ARRAYS: ClassVar = {"tokens": ("<i8", 2), "hit": ("|b1", 1), "q_rows": ("<i8", 1), "q": ("<f2", 3),
                        "q_ids": ("<i8", 1)}
    round_id: int
    tokens: np.ndarray
    hit: np.ndarray
    q_rows: np.ndarray
    q: np.ndarray
    q_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    answer_ms: float = 0.0     # recv -> reply ready (includes backup_ms)
    backup_ms: float = 0.0     # just-in-time decode of missed rows
    build_ms: float = 0.0      # cache builds finished since the previous reply (glue + fork + tree + store) ...
    glue_ms: float = 0.0       # ... their glue forwards
    tree_ms: float = 0.0       # ... their K tree forwards
    builds: int = 0            # how many builds that was (0: none since the previous reply)
    cut_depth: int = -1        # the last of them was cut after this many depths (-1: not cut)
    fast_rows: int = 0         # missed rows answered by the fast (n-gram / random) backup, not the neural one

    def validate(self):
        self.round_id = _int(self.round_id, "round_id", 0, 1 << 62)
        for name in self.TIMINGS:
            setattr(self, name, _float(getattr(self, name), name, 0.0))
        self.builds = _int(self.builds, "builds", 0, 1 << 40)
        self.cut_depth = _int(self.cut_depth, "cut_depth", -1, MAX_K)
        self.fast_rows = _int(self.fast_rows, "fast_rows", 0, MAX_BATCH)
        self.tokens = np.asarray(self.tokens, dtype=np.int64)
        self.hit = np.asarray(self.hit, dtype=np.bool_)
        self.q_rows = np.asarray(self.q_rows, dtype=np.int64).reshape(-1)
        self.q = np.asarray(self.q, dtype=np.float16)
        self.q_ids = np.asarray(self.q_ids, dtype=np.int64).reshape(-1)
        if self.tokens.ndim != 2 or self.q.ndim != 3:
            raise _fail("tokens", "tokens must be [n, K] and q [m, K, V]")
        n, k = self.tokens.shape
        if n > MAX_BATCH or k > MAX_K:
            raise _fail("tokens", f"shape {self.tokens.shape} over limits")
        if self.hit.shape != (n,):
            raise _fail("hit", f"shape {self.hit.shape} != ({n},)")
        m = len(self.q_rows)
        if self.q.shape[0] != m or (m and self.q.shape[1] != k):
            raise _fail("q", f"shape {self.q.shape} does not match {m} q_rows and K = {k}")
        if m and (self.q_rows.min() < 0 or self.q_rows.max() >= n or (np.diff(self.q_rows) <= 0).any()):
            raise _fail("q_rows", "must be strictly increasing row indices in [0, n)")
        if len(self.q_ids):
            if self.q_ids.min() < 0 or self.q_ids.max() >= MAX_VOCAB or (np.diff(self.q_ids) <= 0).any():
                raise _fail("q_ids", "must be strictly increasing token ids in [0, MAX_VOCAB)")
            if m and self.q.shape[2] != len(self.q_ids):
                raise _fail("q", f"width {self.q.shape[2]} != {len(self.q_ids)} q_ids")

    def q_dense(self, vocab_size: int) -> np.ndarray:
        """q [m, K, V] float16 over the full vocabulary (zeros outside q_ids)."""
        if not len(self.q_ids):
            if len(self.q_rows) and self.q.shape[2] != vocab_size:
                raise _fail("q", f"dense width {self.q.shape[2]} != vocab size {vocab_size}")
            return self.q
        return self._scatter(self.q, vocab_size)

    def _scatter(self, q: np.ndarray, vocab_size: int) -> np.ndarray:
        """q [..., W] over q_ids -> [..., V], zeros elsewhere."""
        if self.q_ids[-1] >= vocab_size:
            raise _fail("q_ids", f"id {int(self.q_ids[-1])} >= vocab size {vocab_size}")
        out = np.zeros(q.shape[:-1] + (vocab_size,), dtype=np.float16)
        out[..., self.q_ids] = q
        return out

    def q_for_row(self, row: int, vocab_size: Optional[int] = None) -> Optional[np.ndarray]:
        """float16 [K, V] q of reply row ``row`` (scattered from q_ids when sparse: pass vocab_size), or
        None for a greedy row."""
        pos = np.searchsorted(self.q_rows, row)
        if pos >= len(self.q_rows) or self.q_rows[pos] != row:
            return None
        if not len(self.q_ids):
            return self.q[pos]
        if vocab_size is None:
            raise ValueError("q is sparse (over q_ids): pass vocab_size")
        return self._scatter(self.q[pos], vocab_size)


@dataclass
class Release(Message):
    TYPE: ClassVar[str] = "release"
    HEADER: ClassVar = ("rids",)
    rids: list[str]

    def validate(self):
        self.rids = _str_list(self.rids, "rids", unique=False)


@dataclass
class Health(Message):
    TYPE: ClassVar[str] = "health"


@dataclass
class HealthReply(Message):
    TYPE: ClassVar[str] = "health_reply"
    HEADER: ClassVar = ("stats",)
    stats: dict[str, float] = field(default_factory=dict)

    def validate(self):
        self.stats = _stats(self.stats, "stats")


@dataclass
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"


@dataclass
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    HEADER: ClassVar = ("count", "message")
    count: int = 0      # rows handled
    message: str = ""

    def validate(self):
        self.count = _int(self.count, "count", 0, 1 << 40)
        self.message = _str(self.message, "message", MAX_MESSAGE_STR)


@dataclass
class ErrorReply(Message):
    """The request was rejected as a whole (nothing was changed); ``rids`` names offending rows."""

    TYPE: ClassVar[str] = "error"
    HEADER: ClassVar = ("message", "rids")
    message: str
    rids: list[str] = field(default_factory=list)

    def validate(self):
        self.message = _str(self.message, "message", MAX_MESSAGE_STR)
        self.rids = _str_list(self.rids, "rids", unique=False)


MESSAGE_TYPES: dict[str, type[Message]] = {
    c.TYPE: c for c in (Hello, HelloReply, Prefill, Speculate, SpecReply, Release, Health, HealthReply,
                        Shutdown, Ack, ErrorReply)
}
