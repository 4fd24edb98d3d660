"""Paged KV for the draft: one shared page pool per process, a page table per request.

Why pages: FlashInfer's batch-prefill kernel (the GPU tree attention, flashinfer_attention.py) reads
the KV of every request of a ragged batch from ONE paged tensor per layer through per-request page
lists, whereas ``kv_cache.RequestKV`` gives every request its own tensor.  The slot addressing is
unchanged -- slot s of a request lives at page ``table[s // P]``, offset ``s % P`` -- so the engine,
the tree layout (tree.py) and the SDPA path (attention.py, through ``write``/``view``) work on a
``PagedRequestKV`` exactly as on a ``RequestKV``; this is what the CPU tests use to check it.

Pool layout per layer is FlashInfer's NHD page layout: ``k[layer]`` is [num_pages, P, Hkv, d]
(contiguous), passed to ``BatchPrefillWithPagedKVCacheWrapper.run`` as the tuple (k, v).
Growing the pool reallocates it (``generation`` increments) -- CUDA graphs captured against the old
storage must then be dropped (cuda_graphs.py checks ``generation``); on GPU size it up front.
"""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger(__name__)


class PagedKVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, page_size: int = 16, num_pages: int = 64):
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"page_size and num_pages must be >= 1, got {page_size}, {num_pages}")
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device, self.page_size = dtype, torch.device(device), page_size
        self.generation = 0
        self.num_pages = 0
        self.k = self.v = torch.empty(0)
        self.free: list[int] = []
        self._grow(num_pages)

    def _grow(self, num_pages: int) -> None:
        layers, heads, hd = self.shape
        k = torch.zeros(layers, num_pages, self.page_size, heads, hd, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.num_pages:
            k[:, : self.num_pages] = self.k
            v[:, : self.num_pages] = self.v
            logger.info("draft KV pool grown %d -> %d pages of %d tokens (CUDA graphs re-capture)",
                        self.num_pages, num_pages, self.page_size)
            self.generation += 1
        # hand out low page ids first (pop() takes from the end)
        self.free.extend(range(num_pages - 1, self.num_pages - 1, -1))
        self.k, self.v, self.num_pages = k, v, num_pages

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            need = self.num_pages - len(self.free) + n
            cap = self.num_pages
            while cap < need:
                cap *= 2
            self._grow(cap)
        return [self.free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self.free)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_pages * P, Hkv, d] views of one layer (token-slot addressing for writes)."""
        _, heads, hd = self.shape
        return self.k[layer].view(-1, heads, hd), self.v[layer].view(-1, heads, hd)

    def write_flat(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, Hkv, d] -> global token locations loc [n] (page * P + offset)."""
        kf, vf = self.flat(layer)
        kf.index_copy_(0, loc, k.to(self.dtype))
        vf.index_copy_(0, loc, v.to(self.dtype))

    def new_request(self, capacity: int = 0) -> "PagedRequestKV":
        return PagedRequestKV(self, capacity)


def _release(pool: PagedKVPool, pages: list[int]) -> None:
    pool.release(pages)
    pages.clear()


class PagedRequestKV:
    """Drop-in for ``RequestKV`` (ensure / write / view / capacity / nbytes) backed by pool pages.

    Pages go back to the pool when the object is garbage (weakref.finalize), because the engine
    drops a request simply by forgetting its RequestState; ``free()`` does it explicitly."""

    def __init__(self, pool: PagedKVPool, capacity: int = 0):
        self.features = None  # an EAGLE-3 draft's FeatureBuffer (features.py), set by the runner
        self.pool = pool
        self.pages: list[int] = []
        self._fin = weakref.finalize(self, _release, pool, self.pages)
        self.ensure(capacity)

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_size

    def ensure(self, n_slots: int) -> None:
        p = self.pool.page_size
        need = -(-n_slots // p) - len(self.pages)
        if need > 0:
            self.pages.extend(self.pool.alloc(need))

    def page_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.pages, dtype=torch.int64, device=device)

    def locations(self, slots: torch.Tensor) -> torch.Tensor:
        """Request slots -> global token locations in the pool (page * P + offset)."""
        p = self.pool.page_size
        table = self.page_table(slots.device)
        return table[slots // p] * p + slots % p

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.write_flat(layer, self.locations(slots.to(self.pool.device)), k, v)

    def view(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, kv_len, d] copies of slots [0, kv_len) (gathered: pages are not contiguous)."""
        loc = self.locations(torch.arange(kv_len, device=self.pool.device))
        kf, vf = self.pool.flat(layer)
        return kf[loc].transpose(0, 1), vf[loc].transpose(0, 1)

    def nbytes(self) -> int:
        layers, heads, hd = self.pool.shape
        return 2 * layers * self.capacity * heads * hd * self.pool.k.element_size()

    def free(self) -> None:
        self._fin()
