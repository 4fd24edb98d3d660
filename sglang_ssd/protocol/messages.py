"""The messages between the SGLang worker and the draft process: their fields, arrays and checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import numpy as np

from sglang_ssd.protocol.framing import (BACKUPS, MAX_BATCH, MAX_FAN_OUT, MAX_FEATURE_DIM, MAX_FEATURE_LAYERS, MAX_K,
                                         MAX_MESSAGE_STR, MAX_PROMPT_TOKENS, MAX_VOCAB, MESSAGE_TYPES, MODES, Message, ProtocolError,
                                         _fail, _float, _float_list, _int, _int_list, _same_len, _stats, _str, _str_list)


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
    session's Hello); False = a fresh session, the worker must re-prefill its live requests.
    ``feature_layers``: the target layers whose outputs the draft conditions on (an EAGLE-3 head: HF
    ``hidden_states[id + 1]`` of each id, concatenated, ``feature_dim`` wide); empty = a standalone
    draft, which needs no features.  The worker then sends them with every Speculate."""

    TYPE: ClassVar[str] = "hello_reply"
    HEADER: ClassVar = ("version", "draft_vocab_size", "draft_model_name", "pid", "device", "dtype", "max_batch",
                        "resumed", "feature_layers", "feature_dim")
    version: int
    draft_vocab_size: int
    draft_model_name: str
    pid: int
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = MAX_BATCH
    resumed: bool = False
    feature_layers: list[int] = field(default_factory=list)
    feature_dim: int = 0

    def validate(self):
        self.version = _int(self.version, "version", 0, 1 << 30)
        self.draft_vocab_size = _int(self.draft_vocab_size, "draft_vocab_size", 1, MAX_VOCAB)
        self.draft_model_name = _str(self.draft_model_name, "draft_model_name", 4096)
        self.pid = _int(self.pid, "pid", 0, 1 << 40)
        self.device, self.dtype = _str(self.device, "device"), _str(self.dtype, "dtype")
        self.max_batch = _int(self.max_batch, "max_batch", 1, 1 << 20)
        if not isinstance(self.resumed, bool):
            raise _fail("resumed", "must be a bool")
        self.feature_layers = _int_list(self.feature_layers, "feature_layers", MAX_FEATURE_LAYERS, 0, 1 << 20)
        self.feature_dim = _int(self.feature_dim, "feature_dim", 0, MAX_FEATURE_DIM)
        if bool(self.feature_layers) != (self.feature_dim > 0):
            raise _fail("feature_dim", "must be > 0 exactly when feature_layers are named")


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
    (-1: there was none) followed by ``bonuses[i]``; reply with K drafts after that new context.

    For a draft that asked for target features (HelloReply.feature_layers): row i brings
    ``feat_lens[i]`` of them, for the committed positions ``feat_starts[i]`` .. + feat_lens[i] - 1 (the
    target's verify or prefill computed them; the newest bonus token has none yet), stacked in row
    order in ``features`` [sum(feat_lens), F] float16.  Empty arrays for a standalone draft.

    ``width`` (0 = K): how many drafts per request the worker will verify (its batch-size-aware K).  The
    draft then replies width-token speculations (PAD after them) and builds its cache for width-token
    verifies: outcomes j = 0 .. width, "all width accepted" with the draft's own next token among the
    bonus guesses.  A hint only: an outcome of any length is still looked up (and proposed) correctly."""

    TYPE: ClassVar[str] = "speculate"
    HEADER: ClassVar = ("round_id", "rids", "width")
    ARRAYS: ClassVar = {"ks": ("<i8", 1), "bonuses": ("<i8", 1), "temperatures": ("<f8", 1),
                        "feat_starts": ("<i8", 1), "feat_lens": ("<i8", 1), "features": ("<f2", 2)}
    round_id: int
    rids: list[str]
    ks: list[int]
    bonuses: list[int]
    temperatures: list[float]
    feat_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    feat_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    features: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float16))
    width: int = 0

    def validate(self):
        self.round_id = _int(self.round_id, "round_id", 0, 1 << 62)
        self.width = _int(self.width, "width", 0, MAX_K)
        self.rids = _str_list(self.rids, "rids")
        _same_len("rids", len(self.rids), ks=self.ks, bonuses=self.bonuses, temperatures=self.temperatures)
        self.ks = _int_list(self.ks, "ks", MAX_BATCH, -1, MAX_K)
        self.bonuses = _int_list(self.bonuses, "bonuses", MAX_BATCH, 0, MAX_VOCAB - 1)
        self.temperatures = _float_list(self.temperatures, "temperatures")
        self.feat_starts = np.asarray(self.feat_starts, dtype=np.int64).reshape(-1)
        self.feat_lens = np.asarray(self.feat_lens, dtype=np.int64).reshape(-1)
        self.features = np.asarray(self.features, dtype=np.float16)
        if self.features.ndim != 2 or self.features.shape[1] > MAX_FEATURE_DIM:
            raise _fail("features", f"must be [rows, F <= {MAX_FEATURE_DIM}], got shape {self.features.shape}")
        if not len(self.feat_lens) and not len(self.feat_starts) and not self.features.shape[0]:
            return  # no features (a standalone draft)
        _same_len("rids", len(self.rids), feat_starts=self.feat_starts, feat_lens=self.feat_lens)
        if (self.feat_lens < 0).any() or (self.feat_starts < 0).any() or (self.feat_starts > MAX_PROMPT_TOKENS).any():
            raise _fail("feat_lens", "feature starts and lengths must be >= 0")
        if int(self.feat_lens.sum()) != self.features.shape[0]:
            raise _fail("features", f"{self.features.shape[0]} rows != sum(feat_lens) {int(self.feat_lens.sum())}")

    def features_of(self, row: int) -> tuple[int, np.ndarray]:
        """-> (first position, float16 [feat_lens[row], F]) of row ``row``; (0, empty) without features."""
        if not len(self.feat_lens):
            return 0, self.features[:0]
        off = int(self.feat_lens[:row].sum())
        return int(self.feat_starts[row]), self.features[off: off + int(self.feat_lens[row])]


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


MESSAGE_TYPES.update({
    c.TYPE: c for c in (Hello, HelloReply, Prefill, Speculate, SpecReply, Release, Health, HealthReply,
                        Shutdown, Ack, ErrorReply)
})
