"""Per-request KV cache: one preallocated tensor pair per request, grown by doubling.

Slot s of a request holds the key/value of one token for every layer:
    k[layer, kv_head, s, :], v[layer, kv_head, s, :]
Slots are addressed explicitly by the caller (the runner writes wherever the plan says), so the
same buffer holds the committed prefix, the glue block and the scratch speculation tree.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64


class RequestKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = MIN_CAPACITY):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.capacity = 0
        self.features = None  # an EAGLE-3 draft's FeatureBuffer (features.py), set by the runner
        self.k = self.v = torch.empty(0)
        self.ensure(capacity)

    def ensure(self, n_slots: int) -> None:
        """Make slots [0, n_slots) addressable; doubling keeps growth amortised O(1) per token."""
        if n_slots <= self.capacity:
            return
        cap = max(MIN_CAPACITY, self.capacity)
        while cap < n_slots:
            cap *= 2
        layers, heads, hd = self.shape
        k = torch.zeros(layers, heads, cap, hd, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.capacity:
            k[:, :, : self.capacity] = self.k
            v[:, :, : self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, cap

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, Hkv, d] -> slots [n] of `layer`."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))

    def view(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy [Hkv, kv_len, d] views of slots [0, kv_len)."""
        return self.k[layer, :, :kv_len], self.v[layer, :, :kv_len]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
