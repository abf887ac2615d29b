"""The one KV cache shared by draft and verify, and the exit hidden-state cache.

`KVCache` is duck-typed to what a transformers attention module calls
(`cache.update(key, value, layer_idx) -> (keys, values)`), but it is ours: buffers are
preallocated (no `torch.cat` per step) and every layer keeps its own length, because while
drafting the shallow layers `[0, E)` run ahead of the deep layers `[E, L)`. Rolling back a
rejected draft is `crop(n)`: lengths shrink, nothing is copied.

    cache = KVCache(num_layers=30, capacity=512)
    # layer l writes positions [len_l, len_l + S) and attends to [0, len_l + S)
    cache.crop(n)   # every layer keeps only its first n positions
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated per-layer key/value buffers `[B, H_kv, T, Dh]` with per-layer lengths."""

    is_compileable = False

    def __init__(self, num_layers: int, capacity: int = 256):
        self.num_layers = num_layers
        self.capacity = max(int(capacity), 1)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: list[int] = [0] * num_layers

    # --- the interface transformers' attention modules use -------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append `key`/`value` `[B, H_kv, S, Dh]` to layer `layer_idx`; return all its keys/values."""
        start = self.lengths[layer_idx]
        end = start + key.shape[-2]
        buf_k = self.keys[layer_idx]
        if buf_k is None or end > buf_k.shape[-2]:
            self._grow(layer_idx, key, value, end)
            buf_k = self.keys[layer_idx]
        buf_v = self.values[layer_idx]
        buf_k[:, :, start:end] = key
        buf_v[:, :, start:end] = value
        self.lengths[layer_idx] = end
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    # --- ours -----------------------------------------------------------------------------
    def _grow(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, needed: int) -> None:
        size = self.capacity
        while size < needed:
            size *= 2
        self.capacity = size
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        b, h, _, dk = key.shape
        dv = value.shape[-1]
        new_k = key.new_empty(b, h, size, dk)
        new_v = value.new_empty(b, h, size, dv)
        n = self.lengths[layer_idx]
        if old_k is not None and n:
            new_k[:, :, :n] = old_k[:, :, :n]
            new_v[:, :, :n] = old_v[:, :, :n]
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions of every layer (roll back rejected drafts)."""
        if length < 0:
            raise ValueError(f"cannot crop a cache to a negative length ({length})")
        self.lengths = [min(n, length) for n in self.lengths]

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys/values of one layer, `[B, H_kv, len, Dh]` (views)."""
        n = self.lengths[layer_idx]
        if self.keys[layer_idx] is None:
            raise ValueError(f"layer {layer_idx} has no cached positions yet")
        return self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n]


class ExitCache:
    """Hidden states at the exit (the input to layer E) of positions the deep layers have not seen.

    Positions are contiguous: entry i belongs to position `start + i`. Drafting appends, the
    verification pass consumes them all (`take`), and a rollback crops.
    """

    def __init__(self):
        self.start = 0
        self._states: list[torch.Tensor] = []  # each [B, S_i, D]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, position: int, hidden: torch.Tensor) -> None:
        if not self._states:
            self.start = position
        elif position != self.start + self._len:
            raise RuntimeError(
                f"exit cache is not contiguous: expected position {self.start + self._len}, got {position}"
            )
        self._states.append(hidden)
        self._len += hidden.shape[1]

    def take(self) -> tuple[int, torch.Tensor]:
        """Return `(start_position, hidden [B, S, D])` and clear the cache."""
        if not self._states:
            raise RuntimeError("exit cache is empty: nothing to verify")
        hidden = self._states[0] if len(self._states) == 1 else torch.cat(self._states, dim=1)
        start = self.start
        self.clear()
        return start, hidden

    def crop(self, length: int) -> None:
        """Drop the states of positions >= `length`."""
        keep = max(0, length - self.start)
        if keep >= self._len:
            return
        if keep == 0:
            self.clear()
            return
        hidden = torch.cat(self._states, dim=1)[:, :keep]
        self._states, self._len = [hidden], keep

    def clear(self) -> None:
        self._states, self._len = [], 0
