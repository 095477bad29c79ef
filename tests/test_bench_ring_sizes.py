"""`benchmarks/ring_sizes.py`: the ring sizes it reports are those of the constructed caches (meta device)."""

from __future__ import annotations

from benchmarks.ring_sizes import ring_rows
from hf_loopcache.cache.layers.static import ring_capacity


def test_ring_rows_read_the_caches_rings():
    """RIPE(64) on a micro shape: one row's rings are sized without holes, a batch's with `gamma + 1` positions per
    real token."""
    rows = {(r["batch"], r["block_size"]): r for r in ring_rows(["micro-ouro"], ["ripe64"], [1, 8], [0, 4])}
    assert rows[(1, 4)]["slots"] == [ring_capacity(64, 1, 4, holes=False)] == [70]
    assert rows[(8, 4)]["slots"] == [ring_capacity(64, 1, 4)] == [330]
    assert rows[(1, 0)]["slots"] == rows[(8, 0)]["slots"] == [66]
    assert rows[(8, 4)]["rings"] == rows[(1, 4)]["rings"] > 0
