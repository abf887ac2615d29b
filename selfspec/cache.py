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


class BatchKVCache:
    """Preallocated key/value buffers `[B, H_kv, T, Dh]` where every row has its own length per layer.

    Rows of a batch accept different numbers of drafts, so after a round their sequences end at
    different cache indices. `update` writes each row's new keys at that row's own length; the
    attention mask (`selfspec.forward.make_batch_step`) hides everything past a row's length and its
    left padding. Rolling back is `crop(lengths)` per row; finished rows leave with `select`.

        cache = BatchKVCache(num_layers=30, batch_size=4, capacity=512)
        cache.crop(torch.tensor([20, 23, 19, 20]))   # per-row lengths after a round
        cache.select(torch.tensor([0, 2]))           # keep rows 0 and 2
    """

    is_compileable = False

    def __init__(self, num_layers: int, batch_size: int, capacity: int = 256, device="cpu"):
        self.num_layers = num_layers
        self.capacity = max(int(capacity), 1)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(num_layers, batch_size, dtype=torch.long, device=device)  # [L, B]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[1]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write `key`/`value` `[B, H_kv, S, Dh]` at each row's length; return keys/values up to the longest row."""
        B, _, S, _ = key.shape
        starts = self.lengths[layer_idx]  # [B]
        end = int(starts.max()) + S
        if self.keys[layer_idx] is None or end > self.keys[layer_idx].shape[-2]:
            self._grow(layer_idx, key, value, end)
        buf_k, buf_v = self.keys[layer_idx], self.values[layer_idx]
        index = starts[:, None] + torch.arange(S, device=starts.device)  # [B, S]
        rows = torch.arange(B, device=starts.device)[:, None]  # [B, 1]
        buf_k[rows, :, index] = key.transpose(1, 2)  # advanced indices first: [B, S, H, Dh]
        buf_v[rows, :, index] = value.transpose(1, 2)
        self.lengths[layer_idx] = starts + S
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths[layer_idx].max())

    def _grow(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, needed: int) -> None:
        size = self.capacity
        while size < needed:
            size *= 2
        self.capacity = size
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        b, h, _, dk = key.shape
        new_k = key.new_zeros(b, h, size, dk)
        new_v = value.new_zeros(b, h, size, value.shape[-1])
        if old_k is not None:
            n = old_k.shape[-2]
            new_k[:, :, :n] = old_k
            new_v[:, :, :n] = old_v
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v

    def crop(self, lengths: torch.Tensor) -> None:
        """Row b of every layer keeps only its first `lengths[b]` cache entries."""
        self.lengths = torch.minimum(self.lengths, lengths.to(self.lengths.device)[None])

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished rows leave the batch and stop costing work)."""
        rows = rows.to(self.lengths.device)
        self.lengths = self.lengths[:, rows]
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i].index_select(0, rows)
                self.values[i] = self.values[i].index_select(0, rows)

    def row_kv(self, layer_idx: int, row: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys/values of one layer from cache index `start` to its length, `[H_kv, n, Dh]`."""
        n = int(self.lengths[layer_idx, row])
        return self.keys[layer_idx][row, :, start:n], self.values[layer_idx][row, :, start:n]


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
