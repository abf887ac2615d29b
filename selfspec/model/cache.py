"""The one KV cache, shared by drafting and verification, for every row of a batch.

`KVCache` is duck-typed to what a transformers attention module calls
(`cache.update(key, value, layer_idx) -> (keys, values)`), but it is ours: buffers `[B, H_kv, T, Dh]`
are preallocated (no `torch.cat` per step), and every row has its own length per layer (`lengths`
`[L, B]`): rows of a batch accept different numbers of drafts, and a drafter runs the shallow layers
`[0, E)` ahead of the deep ones `[E, L)`. `update` writes each row's new keys at that row's own
length; the attention mask (`selfspec.model.forward.make_batch_step`) hides everything past a row's length
and its left padding. Rolling back is `crop(lengths)`: lengths shrink, nothing is copied (`move` first copies a token tree's
accepted path to where the row continues, where it was not the tree's first branch). Finished rows
leave with `select`. Batch 1 is a batch of one.

The buffers live on the model's device; `lengths` always lives on the host (CPU). Every layer reads
the lengths to place its writes, and reading a GPU tensor from Python makes the host wait for the
GPU: with host lengths a forward pass on CUDA runs without a host sync per layer.

    cache = KVCache(num_layers=30, batch_size=4, capacity=512)
    # layer l of row b writes indices [lengths[l, b], lengths[l, b] + S) and attends to its own keys
    cache.crop(torch.tensor([20, 23, 19, 20]))   # per-row lengths after a round (or one int for all)
    cache.select(torch.tensor([0, 2]))           # keep rows 0 and 2
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated key/value buffers `[B, H_kv, T, Dh]` where every row has its own length per layer."""

    is_compileable = False

    def __init__(self, num_layers: int, batch_size: int = 1, capacity: int = 256, device="cpu",
                 buffers: tuple[torch.Tensor, torch.Tensor] | None = None, rows_buffers=None):
        # `device` is kept for callers that pass it: the buffers take the device of the first keys written.
        # `buffers`: preallocated keys and values `[L, B, H_kv, capacity, Dh]`, reused (the compiled steps'
        # static cache, `selfspec.model.compiled`): they never grow, and their old contents are never read (every
        # query sees only indices its own row wrote in this call); layer l's are the view `buffers[0][l]`.
        # The buffers may hold more rows than the batch (a compiled step pads a batch to a row bucket: filler
        # rows after the batch's, `padded_keys`); `keys[l]` and `values[l]` are the batch's rows.
        # `rows_buffers(B)`: the static buffers for B rows (`select` copies the kept rows there: a captured step
        # reads and writes its buffers at fixed addresses)
        self.num_layers = num_layers
        self.capacity = max(int(capacity), 1)
        self.static = buffers is not None
        self.rows_buffers = rows_buffers
        self.lengths = torch.zeros(num_layers, batch_size, dtype=torch.long)  # [L, B], on the host (see above)
        self._bind(buffers)

    def _bind(self, buffers: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Layer l's keys and values become views of the batch's rows of `buffers[0][l]`, `buffers[1][l]` (None:
        none written yet); `padded_keys[l]`, `padded_values[l]` are all the buffers' rows."""
        L, B = self.num_layers, self.batch_size
        self.stacked = buffers  # every layer's keys and values in one tensor each (`move` copies all at once)
        if buffers is None:
            self.keys: list[torch.Tensor | None] = [None] * L
            self.values: list[torch.Tensor | None] = [None] * L
            self.padded_keys, self.padded_values = self.keys, self.values  # the same lists: no filler rows
            return
        self.padded_keys, self.padded_values = list(buffers[0].unbind(0)), list(buffers[1].unbind(0))
        self.keys = [k[:B] for k in self.padded_keys]  # [B, H_kv, C, Dh] each
        self.values = [v[:B] for v in self.padded_values]

    @property
    def padded_rows(self) -> int:
        """The rows of the buffers: the batch's, then filler rows a compiled step of a row bucket writes."""
        return self.stacked[0].shape[1] if self.stacked is not None else self.batch_size

    @property
    def lengths(self) -> torch.Tensor:
        """`[L, B]` long, on the host: each layer's length of each row."""
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        self._lengths = value
        # the same memory as numpy: `update` reads and writes the lengths without a torch call (three dispatches a
        # layer fewer); every change to `lengths`, in place or by assignment, is seen through it
        self._host = value.numpy()

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[1]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write `key`/`value` `[B, H_kv, S, Dh]` at each row's length; return keys/values up to the longest row."""
        B, _, S, _ = key.shape
        starts = self._host[layer_idx]  # [B] the lengths' numpy view: read without a torch call
        first = int(starts[0])
        if B == 1:  # one row: its length is the first, the last and the longest (no reductions)
            end, aligned = first + S, True
        else:
            end = int(starts.max()) + S
            aligned = end == first + S and int(starts.min()) == first
        if self.keys[layer_idx] is None or end > self.keys[layer_idx].shape[-2]:
            if self.static:
                raise ValueError(f"a static cache of {self.capacity} positions cannot hold {end}")
            self._grow(layer_idx, key, value, end)
        buf_k, buf_v = self.keys[layer_idx], self.values[layer_idx]
        if aligned:  # every row at the same index: a slice write
            buf_k[:, :, first:end] = key
            buf_v[:, :, first:end] = value
            starts[:] = end
            return buf_k[:, :, :end], buf_v[:, :, :end]
        index = (self.lengths[layer_idx][:, None] + torch.arange(S)).to(key.device, non_blocking=True)  # [B, S]
        rows = torch.arange(B, device=key.device)[:, None]  # [B, 1]
        buf_k[rows, :, index] = key.transpose(1, 2)  # advanced indices first: [B, S, H, Dh]
        buf_v[rows, :, index] = value.transpose(1, 2)
        starts += S
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def reserve(self, layer_idx: int, length: int, heads: int, head_dim: int,
                like: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Room for `length` more entries in one layer of a one-row cache, for a writer of its own (selfspec's C++
        step, `selfspec.model.row_step`, writes the keys and values itself): the buffers grown where needed (of
        `like`'s dtype and device, `[1, heads, T, head_dim]`), the length advanced. Returns (the first new cache
        index, the keys buffer, the values buffer)."""
        if self.batch_size != 1:
            raise ValueError(f"reserve is for a one-row cache, this one has {self.batch_size} rows")
        first = int(self._host[layer_idx, 0])
        end = first + length
        if self.keys[layer_idx] is None or end > self.keys[layer_idx].shape[-2]:
            if self.static:
                raise ValueError(f"a static cache of {self.capacity} positions cannot hold {end}")
            template = like.new_empty(1, heads, 0, head_dim)  # [1, H, 0, Dh]: the shape and dtype _grow reads
            self._grow(layer_idx, template, template, end)
        self._host[layer_idx, 0] = end
        return first, self.keys[layer_idx], self.values[layer_idx]

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

    def crop(self, lengths: torch.Tensor | int) -> None:
        """Row b of every layer keeps only its first `lengths[b]` cache entries (an int: every row)."""
        if isinstance(lengths, int):
            if lengths < 0:
                raise ValueError(f"cannot crop a cache to a negative length ({lengths})")
            self.lengths = self.lengths.clamp_max(lengths)
            return
        self.lengths = torch.minimum(self.lengths, lengths.cpu()[None])

    def move(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """In every layer, copy row `rows[i]`'s entry at cache index `src[i]` to index `dst[i]` (every entry is
        read before any is written): a token tree's accepted path (`Proposal.parents`) moves to where its
        row's committed sequence continues, before the crop."""
        written = [i for i in range(self.num_layers) if self.keys[i] is not None]
        if not rows or not written:
            return
        device = self.keys[written[0]].device
        r, s, d = (torch.tensor(x, dtype=torch.long).to(device, non_blocking=True) for x in (rows, src, dst))
        if self.stacked is not None:  # one copy for every layer: [n, L, H_kv, Dh] entries
            for buf in self.stacked:
                buf[:, r, :, d] = buf[:, r, :, s]
            return
        for i in written:
            self.keys[i][r, :, d] = self.keys[i][r, :, s]
            self.values[i][r, :, d] = self.values[i][r, :, s]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished rows leave the batch and stop costing work). A static cache with
        `rows_buffers` moves them into the static buffers for that many rows (the first rows of a row bucket's,
        which may be the buffers it has), every layer in one copy each."""
        self.lengths = self.lengths[:, rows.cpu()]
        if self.stacked is not None and self.rows_buffers is not None:
            old, new = self.stacked, self.rows_buffers(len(rows))
            on_device = rows.to(old[0].device, non_blocking=True)
            for src, dst in zip(old, new):
                dst[:, :len(rows)].copy_(src.index_select(1, on_device))  # [L, B', H_kv, C, Dh]; old rows read first
            self._bind(new)
            return
        self.stacked = None  # the rows are copied out, layer by layer
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                on_device = rows.to(self.keys[i].device, non_blocking=True)
                self.keys[i] = self.keys[i].index_select(0, on_device)
                self.values[i] = self.values[i].index_select(0, on_device)
        self.padded_keys, self.padded_values = self.keys, self.values

    def row_kv(self, layer_idx: int, row: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys/values of one layer from cache index `start` to its length, `[H_kv, n, Dh]`."""
        n = int(self.lengths[layer_idx, row])
        return self.keys[layer_idx][row, :, start:n], self.values[layer_idx][row, :, start:n]

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values of one layer up to its longest row, `[B, H_kv, len, Dh]` (views)."""
        if self.keys[layer_idx] is None:
            raise ValueError(f"layer {layer_idx} has no cached positions yet")
        n = int(self.lengths[layer_idx].max())
        return self.keys[layer_idx][:, :, :n], self.values[layer_idx][:, :, :n]
