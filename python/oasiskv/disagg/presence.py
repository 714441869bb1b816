"""Which staged block-heads the decode side's host pool holds (:class:`PresenceMap`): per host row
the staged request that owns it and the logical block it holds, per ``(layer, host row, KV
head)`` whether its bytes are there, and how many entries are still only in the daemon. The
finding of the absent entries of a plan (:meth:`PresenceMap.absent`) is here; the reads that
fill them are :class:`~oasiskv.disagg.remote.RemoteKvSource`'s.
"""

from __future__ import annotations

from collections.abc import Collection

import torch


class PresenceMap:
    """The presence of the staged block-heads in the host pool.

    ``owner [rows]``: the engine request id of the staged request that holds each host row (-1:
    local); ``logical [rows]``: the logical block it holds; ``present [layers, rows, heads]``:
    whether the entry holds its bytes (a row holding no staged block counts as present: nothing
    to read); ``missing``: entries of rows holding a staged block, not read yet, all layers.
    The pools grow (:meth:`grow`); the maps follow them.
    """

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.owner = torch.full((0,), -1, dtype=torch.long)
        self.logical = torch.zeros(0, dtype=torch.long)
        self.present = torch.ones(0, 0, 0, dtype=torch.bool)
        self.missing = 0

    def grow(self, num_rows: int) -> None:
        """Cover ``num_rows`` host rows (the pools may have grown; new rows are local)."""
        n = num_rows
        old = self.owner.shape[0]
        if n <= old and self.present.numel():
            return
        hk = self.num_kv_heads
        extra = max(0, n - old)
        self.owner = torch.cat([self.owner, torch.full((extra,), -1, dtype=torch.long)])
        self.logical = torch.cat([self.logical, torch.zeros(extra, dtype=torch.long)])
        layers = self.num_layers
        if not self.present.numel():
            self.present = torch.ones(layers, n, hk, dtype=torch.bool)
        else:
            self.present = torch.cat([self.present, torch.ones(layers, extra, hk, dtype=torch.bool)], dim=1)

    def set_owner(self, row: int, owner: int) -> None:
        """``row`` names ``owner`` without holding a staged block (a bounded cache's filler)."""
        self.owner[row] = owner

    def take_row(self, row: int, owner: int, logical: int) -> None:
        """Host row ``row`` now holds staged block ``logical`` of ``owner``: nothing of it read."""
        self.owner[row] = owner
        self.logical[row] = logical
        self.present[:, row] = False
        self.missing += len(self.present) * self.num_kv_heads

    def forget_row(self, row: int) -> int:
        """The block in ``row`` was evicted: its bytes are gone (nothing left to read of it).
        Returns how many of its entries held their bytes."""
        had = int(self.present[:, row].sum())
        self.missing -= len(self.present) * self.num_kv_heads - had
        self.present[:, row] = True
        return had

    def release(self, rows: torch.Tensor) -> None:
        """A staged request's ``rows`` go back to the pool: local again, nothing to read."""
        if rows.numel() and self.present.numel():
            self.missing -= int((~self.present[:, rows]).sum())
            self.present[:, rows] = True
            self.owner[rows] = -1

    def filled(self, entries: int) -> None:
        """``entries`` block-heads marked present were read (no longer missing)."""
        self.missing -= entries

    def mark_present(self, layers: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor | None):
        """Entries now in the host pool: block-heads ``(layers[i], rows[i], heads[i])``, or with
        ``heads`` None every head of the row. How many of each entry's were absent before."""
        if heads is None:
            new = (~self.present[layers, rows]).sum(dim=1)
            self.present[layers, rows] = True
        else:
            new = (~self.present[layers, rows, heads]).long()
            self.present[layers, rows, heads] = True
        return new

    def mark_blocks(self, layer: int, rows: torch.Tensor) -> int:
        """Every head of ``rows`` of ``layer`` now in the host pool; how many were absent."""
        present = self.present[layer]
        new = int((~present[rows]).sum())
        present[rows] = True
        return new

    def absent_blocks(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """The ``rows`` of ``layer`` with some head not in the host pool."""
        return rows[~self.present[layer][rows].all(dim=1)]

    def absent(self, layers: torch.Tensor, hb: torch.Tensor, head: torch.Tensor, failed: Collection[int]):
        """The block-heads ``(layers[i], hb[i], head[i])`` not in the host pool, each once and
        none of a ``failed`` request, as ``(layers, hb, head)`` ordered by (layer, row, head), as
        a read wants them; None when there are none."""
        absent = ~self.present[layers, hb, head]
        if not bool(absent.any()):
            return None
        layers, hb, head = layers[absent], hb[absent], head[absent]
        if failed:
            ok = ~torch.isin(self.owner[hb], torch.tensor(list(failed), dtype=torch.long))
            layers, hb, head = layers[ok], hb[ok], head[ok]
            if not hb.numel():
                return None
        rows, hk = self.present.shape[1], self.num_kv_heads
        key = torch.unique((layers * rows + hb) * hk + head)  # one key per (layer, row, head), sorted
        layers, rest = key // (rows * hk), key % (rows * hk)
        return layers, rest // hk, rest % hk
