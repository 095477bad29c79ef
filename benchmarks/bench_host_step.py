"""Host time of a replayed decode step: `DecodeGraphs.__call__` on the CPU with the tests' stand-in graphs
(`tests.helpers.stand_in_graphs`) and a replay that does nothing, so only the Python work around `graph.replay()` is
timed (input copies, the mask's earlier columns, the host lengths of every cell, the output object). Ouro-1.4B's cell
count (24 layers x 4 loops = 96 cells, tiny widths), batch 1. Prints the minimum, 10th percentile and median over
1,050 steps, each timed alone (on a shared CPU the low percentiles are the least disturbed).

    PYTHONPATH=$PWD python -m benchmarks.bench_host_step
"""

from __future__ import annotations

import time

import pytest
import torch

from hf_loopcache import FullLoopCache
from hf_loopcache.models._graphs import DecodeGraphs
from tests import helpers


def main(rounds: int = 7, steps: int = 150, batch: int = 1) -> dict[str, float]:
    patch = pytest.MonkeyPatch()
    helpers.stand_in_graphs(patch)
    model = helpers.tiny_ouro(num_hidden_layers=24, total_ut_steps=4)
    n = rounds * steps
    cache = FullLoopCache(model, static=True, max_batch_size=batch, max_cache_len=8 + 3 + n + 1)
    ids = torch.randint(3, 60, (batch, 8))
    mask = torch.ones(batch, 8, dtype=torch.long)
    call = DecodeGraphs(model)
    step = torch.randint(3, 60, (batch, 1))
    per = []
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(3):  # the warm-up and capture, then replays
            mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
            call(input_ids=step, attention_mask=mask, past_key_values=cache, use_cache=True)
        entry = next(e for e in cache._graphs.values() if e is not None)
        entry.graph.replay = lambda: None  # the host side only
        masks = []
        for _ in range(n):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
            masks.append(mask)
        for m in masks:
            start = time.perf_counter()
            call(input_ids=step, attention_mask=m, past_key_values=cache, use_cache=True)
            per.append(time.perf_counter() - start)
    patch.undo()
    per.sort()
    row = {"cells": len(cache.cells), "min_us": per[0] * 1e6, "p10_us": per[n // 10] * 1e6, "median_us": per[n // 2] * 1e6}
    print(f"{row['cells']} cells, host us per replayed step ({n} steps): min {row['min_us']:.1f}, "
          f"p10 {row['p10_us']:.1f}, median {row['median_us']:.1f}")
    return row


if __name__ == "__main__":
    main()
