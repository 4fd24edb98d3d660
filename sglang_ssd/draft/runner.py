"""DraftRunner: one batched forward of the draft model over a ragged list of per-request work items.

Every item says which tokens to run, at which RoPE positions, into which KV slots of its request's
cache they go, which slots they may see (explicit mask) and how many trailing rows need logits.
Extends (prefill, glue, just-in-time decode) and tree depths are all just items.

Attention backend (``select_backend``, logged at start): on a CUDA device with flashinfer importable
and a half-precision draft, FlashInfer custom-mask attention over a paged KV pool
(flashinfer_attention.py, paged_kv.py), with CUDA graphs per (requests, tokens) bucket for the
small forwards (cuda_graphs.py); otherwise torch SDPA over per-request caches (attention.py).
Both consume the same per-item masks (tree.py), so the tree layout is identical.  FlashInfer is
warmed up (its kernels JIT-compiled and checked against SDPA) and the start-up graphs captured in
the constructor, i.e. before the draft reports READY; a failed warm-up falls back to SDPA
(``start_attention``).

An EAGLE-3 head (eagle3.py) runs through the same items: each row also reads its parent slot's
feature (features.py) and leaves its own output there; extends whose rows depend on each other's
outputs are cut into passes (``features.split_extend``).  Its forwards run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_ssd.draft.attention import AttnSeq, BatchAttention
from sglang_ssd.draft.cpu_dtype import cpu_auto_dtype
from sglang_ssd.draft.cpu_linear import route_linears
from sglang_ssd.draft.eagle3 import Eagle3Draft, load_draft
from sglang_ssd.draft.features import FeatureBuffer, parents_of, split_extend
from sglang_ssd.draft.flashinfer_attention import select_backend
from sglang_ssd.draft.kv_cache import RequestKV
from sglang_ssd.draft.model import CausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAGE_SIZE = 16
POOL_TOKENS = 1 << 16   # initial paged-pool size on GPU (grows by doubling; growth re-captures graphs)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA (half the memory traffic, what FlashInfer needs); on a CPU bfloat16 where
    its bf16 GEMMs are measured faster than float32 ones (AMX / AVX512-BF16), else float32 (cpu_dtype.py)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else cpu_auto_dtype()
    return DTYPES[dtype]


@dataclass
class ForwardItem:
    kv: RequestKV
    tokens: torch.Tensor      # [q] long
    positions: torch.Tensor   # [q] long (RoPE)
    slots: torch.Tensor       # [q] long (KV slots written)
    kv_len: int               # attend to slots [0, kv_len)
    mask: Optional[torch.Tensor]  # bool [q, kv_len]; None: causal extend (slots kv_len-q..kv_len-1)
    n_logits: int = 1         # logits for the last n_logits rows

    @classmethod
    def extend(cls, kv: RequestKV, tokens: Sequence[int], start: int, n_logits: int = 1) -> "ForwardItem":
        """Causal extend: tokens at slots = positions start..start+q-1, each seeing every slot up to
        itself.  mask None: its [q, start+q] block is built only by a path that needs it (SDPA, a
        graph, a batch mixed with tree items); an all-extend FlashInfer batch runs causal=True."""
        q = len(tokens)
        idx = torch.arange(start, start + q)
        return cls(kv, torch.as_tensor(list(tokens), dtype=torch.long), idx, idx, start + q, None, n_logits)


class DraftRunner:
    def __init__(self, model: CausalLM | Eagle3Draft, device: str | torch.device = "cpu", attention: str = "auto",
                 cuda_graphs: bool = True, page_size: int = PAGE_SIZE, pool_tokens: int = POOL_TOKENS):
        self.model = model
        self.eagle = isinstance(model, Eagle3Draft)  # feature-conditioned: reads the target's features
        self.cfg = model.cfg.base if self.eagle else model.cfg
        self.device = torch.device(device)
        self.dtype = (model.embed_tokens if self.eagle else model.model.embed_tokens).weight.dtype
        cuda_graphs = cuda_graphs and not self.eagle
        self.forward_calls = 0
        self.forward_tokens = 0
        # column space: a reduced head's rows sorted by token id once (so column order = id order and
        # argmax ties break as over the full vocabulary); cols[c] = token id of column c
        self.cols = self._col_of = None
        if getattr(model, "head_ids", None) is not None:
            order = model.head_ids.argsort()
            with torch.no_grad():
                model.lm_head.weight.copy_(model.lm_head.weight[order])
                model.head_ids.copy_(model.head_ids[order])
            self.cols = model.head_ids.to(self.device)
            self._col_of = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.device)
            self._col_of[self.cols] = torch.arange(self.cols.numel(), device=self.device)
        # a CPU draft's linears on oneDNN-packed weights where measured faster (cpu_linear.py)
        self.packed_linears = route_linears(model, self.dtype) if self.device.type == "cpu" else 0
        self.pool = self.workspace = self.graphs = None
        self.backend_fallback: Optional[str] = None  # why FlashInfer was selected but not kept
        self.backend = "sdpa"
        self.start_attention(select_backend(self.device, attention, self.dtype), cuda_graphs, page_size,
                             pool_tokens)

    def start_attention(self, backend: str, cuda_graphs: bool = True, page_size: int = PAGE_SIZE,
                        pool_tokens: int = POOL_TOKENS) -> str:
        """Bring up `backend` on this runner's device and return the backend in use.

        FlashInfer compiles its kernels on first use (flashinfer 0.7.2's JIT; SGLang pulls no
        prebuilt cubins), which fails without nvcc and takes long with it.  So its set-up runs the
        dummy forwards of flashinfer_attention.warm_up_flashinfer (causal and tree-mask variants) here,
        before the draft reports READY, and if anything in it raises the runner falls back to SDPA
        with one WARNING naming the cause -- the first compile never happens inside a live round.
        CUDA graphs are then captured for the start-up buckets (cuda_graphs.GraphRunner.capture_startup);
        a capture failure turns graphs off (FlashInfer eager stays)."""
        if backend != "flashinfer":
            self.backend = backend
            return backend
        from sglang_ssd.draft.flashinfer_attention import FlashInferWorkspace, pool_pages_for, warm_up_flashinfer

        try:  # GPU only (checked on an H200: results/gpu_draft_check.md)
            from sglang_ssd.draft.paged_kv import PagedKVPool

            c = self.cfg
            self.pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device,
                                    page_size, pool_pages_for(pool_tokens, page_size))
            self.workspace = FlashInferWorkspace(self.device)
            warm_up_flashinfer(self.pool, self.workspace, c.num_heads)
        except Exception as exc:
            self.pool = self.workspace = None
            self.backend, self.backend_fallback = "sdpa", f"{type(exc).__name__}: {exc}"
            logger.warning("draft attention: FlashInfer warm-up failed on %s (%s); falling back to SDPA",
                           self.device, self.backend_fallback)
            return self.backend
        self.backend = "flashinfer"
        if cuda_graphs:
            self._start_graphs()
        else:
            logger.info("draft CUDA graphs: off")
        return self.backend

    def _start_graphs(self) -> None:
        from sglang_ssd.draft.cuda_graphs import GraphRunner, graph_budget_bytes

        try:
            self.graphs = GraphRunner(self.model, self.pool, self.device)
            self.graphs.capture_startup(graph_budget_bytes())
        except Exception as exc:  # e.g. out of memory: eager FlashInfer still works
            self.graphs = None
            logger.warning("draft CUDA graphs: start-up capture failed (%s: %s); running eager",
                           type(exc).__name__, exc)

    def health(self) -> dict[str, float]:
        """Numbers for the draft's Health reply: which attention runs, whether FlashInfer fell back
        (the reason is in the WARNING log line), and the CUDA graphs held."""
        g = self.graphs
        return {"attention_flashinfer": int(self.backend == "flashinfer"),
                "attention_fallback": int(self.backend_fallback is not None),
                "packed_linears": self.packed_linears,
                "cuda_graphs": len(g.graphs) if g is not None else 0,
                "cuda_graph_replays": g.replays if g is not None else 0,
                "cuda_graph_mem_mb": g.startup_bytes / 2**20 if g is not None else 0.0}

    @classmethod
    def from_dir(cls, model_dir: str, device: str = "cpu", dtype: str | torch.dtype = "auto",
                 attention: str = "auto", cuda_graphs: bool = True,
                 target_dir: Optional[str] = None) -> "DraftRunner":
        """target_dir: the target's checkpoint, read only for an EAGLE-3 head (its embedding, layer count)."""
        model = load_draft(model_dir, device, resolve_dtype(dtype, device), target_dir)
        return cls(model, device, attention, cuda_graphs)

    @property
    def feature_layers(self) -> list[int]:
        """Target layers whose outputs the draft conditions on (empty: a standalone draft)."""
        return list(self.model.cfg.aux_layer_ids) if self.eagle else []

    @property
    def feature_dim(self) -> int:
        """Width of one position's target features as the worker sends them (n_aux x target hidden)."""
        return self.model.cfg.num_aux * self.model.cfg.target_hidden_size if self.eagle else 0

    @torch.no_grad()
    def put_features(self, kv, start: int, target_features: torch.Tensor) -> None:
        """The target's features [m, F] for positions start.. of a request: projected by the head's fc."""
        proj = self.model.project(target_features.to(self.device, self.dtype))
        kv.features.put_target(start, proj)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def n_cols(self) -> int:
        """Width of the column space the hot path works in: the head's own ids (reduced head) or V."""
        return self.vocab_size if self.cols is None else int(self.cols.numel())

    def to_tokens(self, cols: torch.Tensor) -> torch.Tensor:
        """Column indices (any shape) -> vocabulary token ids."""
        return cols if self.cols is None else self.cols[cols.to(self.cols.device)]

    def to_cols(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary token ids -> column indices, -1 for ids the head does not cover."""
        return tokens if self._col_of is None else self._col_of[tokens.to(self._col_of.device)]

    def new_kv(self, capacity: int = 64):
        """A request's KV: pool pages on the FlashInfer path, else its own RequestKV tensors."""
        c = self.cfg
        kv = (self.pool.new_request(capacity) if self.pool is not None else
              RequestKV(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device, capacity))
        if self.eagle:  # each slot's feature beside its KV
            kv.features = FeatureBuffer(c.hidden_size, self.dtype, self.device, capacity)
        return kv

    @torch.no_grad()
    def forward(self, items: Sequence[ForwardItem], cols: bool = False) -> list[torch.Tensor]:
        """-> per item float32 logits [n_logits, V] of its last n_logits rows; cols=True: over the column
        space instead ([n_logits, n_cols]; a reduced head's own ids, never scattered to V)."""
        if not items:
            return []
        for it in items:
            it.kv.ensure(max(it.kv_len, int(it.slots.max()) + 1))
        if self.eagle:
            return self._forward_passes(items, cols)
        return self._forward_once(items, cols)

    def _forward_passes(self, items: Sequence[ForwardItem], cols: bool) -> list[torch.Tensor]:
        """EAGLE-3: each item cut into passes (features.split_extend; a tree depth is one pass), pass i
        of every item batched together; logits re-assembled per item in row order."""
        pieces = []
        for it in items:
            q = len(it.tokens)
            spans = [(0, q)] if it.mask is not None else split_extend(it.kv.features, int(it.slots[0]), q)
            subs = []
            for a, b in spans:  # a causal extend's rows a..b-1 see slots up to their own
                n_log = max(0, min(b, q) - max(a, q - it.n_logits))
                subs.append(it if (a, b) == (0, q) else
                            ForwardItem(it.kv, it.tokens[a:b], it.positions[a:b], it.slots[a:b],
                                        int(it.slots[b - 1]) + 1, None, n_log))
            pieces.append(subs)
        outs: list[list[torch.Tensor]] = [[] for _ in items]
        for p in range(max(len(s) for s in pieces)):
            idx = [i for i, s in enumerate(pieces) if p < len(s)]
            for i, lg in zip(idx, self._forward_once([pieces[i][p] for i in idx], cols)):
                outs[i].append(lg)
        return [torch.cat(o) for o in outs]

    def _forward_once(self, items: Sequence[ForwardItem], cols: bool) -> list[torch.Tensor]:
        dev = self.device
        # non_blocking: a pageable host->device copy is staged at once, without waiting for the device
        ids = torch.cat([it.tokens for it in items]).to(dev, non_blocking=True)
        pos = torch.cat([it.positions for it in items]).to(dev, non_blocking=True)
        seqs = [AttnSeq(it.kv, it.slots, it.kv_len, it.mask) for it in items]
        hidden = self.graphs.run(seqs, ids, pos) if self.graphs is not None else None
        if self.eagle:  # each row's parent feature in, each row's own output feature out
            feats = torch.cat([it.kv.features.gather(parents_of(it.slots, it.mask).to(dev)) for it in items])
            hidden, nxt = self.model(ids, pos, feats, self._attention(seqs))
            for it, o in zip(items, torch.split(nxt, [len(it.tokens) for it in items])):
                it.kv.features.store(it.slots.to(dev), o)
        elif hidden is None:  # eager: no graphs, or no bucket fits (prefill chunks)
            hidden = self.model(ids, pos, self._attention(seqs))
        # only the rows that need logits go through the (large) LM head
        rows, off = [], 0
        for it in items:
            q = len(it.tokens)
            rows.append(torch.arange(off + q - it.n_logits, off + q))
            off += q
        h = hidden[torch.cat(rows).to(dev, non_blocking=True)]
        logits = self.model.head_logits(h) if cols else self.model.logits(h)
        self.forward_calls += 1
        self.forward_tokens += off
        return list(torch.split(logits, [it.n_logits for it in items]))

    def _attention(self, seqs: Sequence[AttnSeq]):
        if self.backend == "flashinfer":
            from sglang_ssd.draft.flashinfer_attention import FlashInferAttention

            return FlashInferAttention(seqs, self.pool, self.workspace, self.cfg.num_heads, self.dtype)
        return BatchAttention(seqs, self.device)
