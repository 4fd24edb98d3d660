"""Framing of sglang-ssd messages: limits, field checkers, the Message base class, encode and decode
(the wire format is described in sglang_ssd/protocol/__init__.py; the messages are in messages.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence, Union

import msgpack
import numpy as np

MAGIC = "sglang-ssd"
PROTOCOL_VERSION = 9  # 2: Prefill carries per-request Saguaro sampling C; Hello the backup kind
                      # 3: HelloReply says whether the session was resumed (state kept)
                      # 4: Prefill.round0: build a round-0 cache (sent while the target prefills)
                      # 5: SpecReply.q_ids: q travels over the draft head's token ids only
                      # 6: SpecReply.builds / cut_depth / fast_rows (for the worker's metrics)
                      # 7: backup "hybrid" (one neural draft step, then n-gram; counted in fast_rows)
                      # 8: target features for EAGLE-3 drafts (HelloReply.feature_layers, Speculate.features)
                      # 9: Speculate.width: the drafts the worker verifies per request (batch-size-aware K)
BACKUPS = ("neural", "fast", "hybrid", "auto")
MAX_HEADER_BYTES = 4 << 20        # msgpack header frame
MAX_FRAME_BYTES = 1 << 30         # any array frame (q of a large batch is the big one)
MAX_BATCH = 4096                  # rows per Prefill / Speculate / Release
MAX_K = 64                        # drafts per round
MAX_FAN_OUT = 1024                # branches forked at one glue index
MAX_VOCAB = 1 << 22
MAX_PROMPT_TOKENS = 1 << 24       # total tokens in one Prefill
MAX_FEATURE_DIM = 1 << 17         # width of one position's target features (n_aux x hidden size)
MAX_FEATURE_LAYERS = 64           # target layers a draft may ask features of
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
# framing
# ---------------------------------------------------------------------------------------------
MESSAGE_TYPES: dict[str, type["Message"]] = {}  # type name -> class; filled by messages.py


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
