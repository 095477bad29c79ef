"""Host time of a replayed decode step on the CPU, with the tests' stand-in graphs (`tests.helpers.stand_in_graphs`)
and a replay that does nothing, so only the Python and dispatcher work around `graph.replay()` is timed. Ouro-1.4B's
cell count (24 layers x 4 loops = 96 cells, tiny widths), batch 1, fp32, one torch thread.

transformers' `generate` (up to 5.24 on CUDA) reads a device value at every step's stop check
(`StopCheck`: `bool(unfinished_sequences.max() == 0)`), so the host waits for the replayed graph there. What the GPU
then waits for is the host work from that read to the next replay (`exposed`: the rest of the stop check,
`prepare_inputs_for_generation`, our inputs' copies, the graph launch), plus the small kernels launched after the
replay, which run after the graph. The host work after the replay (`overlapped`: the output, transformers'
bookkeeping, processors, stopping criteria) runs while the graph runs and costs the GPU nothing but those kernels.

Measurements (on a shared CPU the low percentiles are the least disturbed; each prints min, p10 and median):

- `call` (default): `DecodeGraphs.__call__` alone, each of 1,050 calls timed on its own (the full mask's earlier
  columns, the input copies, the cells' host lengths, the output object), and its part before the replay.
- `generate` (`--generate`): whole steps of `model.generate` (greedy, the model's eos, the compiled-call path taken on
  the CPU by `CompileConfig._compile_all_devices`), from one step's `prepare_inputs_for_generation` to the next;
  `exposed` and `overlapped` as above; and the step split into the calls of transformers' `_sample` loop:
  `prepare_inputs_for_generation` (transformers'; it reads the cache's `is_linear` and the model's `device` and
  `dtype`, ours), the forward (`DecodeGraphs.__call__`, ours), `_update_model_kwargs_for_generation`, the logits
  processors (transformers' list; with greedy defaults only ours, `_NonFiniteLogits`), the stopping criteria and the
  stop check (transformers'), and the rest of `_sample`'s loop body (the logits copy, argmax, eos fill, the
  `input_ids` concatenation). The replay returns fixed logits whose argmax is not eos, so every call runs all steps.
- `ops` (`--ops`): the torch ops of one steady step outside the graph (each a kernel launch on a GPU, views left out),
  after the replay and from the stop check to the next replay.

Session 13 (`benchmarks/results/host_step_cpu_s13.json`, p10, this CPU, transformers 5.24): a generate step 264 ->
172 us, of which exposed 100 -> 60 us; `DecodeGraphs.__call__` 31 -> 27 us (before its replay 21 -> 17 us); 28 -> 21
ops after the replay. Of the exposed 60 us, `prepare_inputs_for_generation` is 35 us, transformers' own but for 4 us
(six config reads at 2 us each through `PretrainedConfig.__getattribute__`, a `deprecate_kwarg` wrapper, the input
slice and clone, a `torch.empty` for the mask function, the kwargs loop).

    PYTHONPATH=$PWD python -m benchmarks.bench_host_step [--generate] [--ops] [--steps N] [--prompt P] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from typing import Any

import pytest
import torch

from hf_loopcache import FullLoopCache
from hf_loopcache.models._graphs import DecodeGraphs
from tests import helpers


def _stats(per: list[float]) -> dict[str, float]:
    per = sorted(per)
    n = len(per)
    return {"min_us": round(per[0] * 1e6, 1), "p10_us": round(per[n // 10] * 1e6, 1), "median_us": round(per[n // 2] * 1e6, 1)}


def _model() -> Any:
    return helpers.tiny_ouro(num_hidden_layers=24, total_ut_steps=4)


def main(rounds: int = 7, steps: int = 150, batch: int = 1) -> dict[str, float]:
    """`DecodeGraphs.__call__` alone: min, p10 and median microseconds over `rounds * steps` calls."""
    patch = pytest.MonkeyPatch()
    helpers.stand_in_graphs(patch)
    model = _model()
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
        replays: list[float] = []
        entry.graph.replay = functools.partial(_stamp, replays)  # the host side only
        masks = []
        for _ in range(n):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
            masks.append(mask)
        starts = []
        for m in masks:
            start = time.perf_counter()
            call(input_ids=step, attention_mask=m, past_key_values=cache, use_cache=True)
            per.append(time.perf_counter() - start)
            starts.append(start)
    patch.undo()
    row = {"cells": len(cache.cells), **_stats(per), "before_replay": _stats([r - s for s, r in zip(starts, replays)])}
    print(f"{row['cells']} cells, host us per DecodeGraphs call ({n} calls): min {row['min_us']:.1f}, "
          f"p10 {row['p10_us']:.1f}, median {row['median_us']:.1f}; before its replay: "
          + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in row["before_replay"].items()))
    return row


def _stamp(into: list[float]) -> None:
    into.append(time.perf_counter())


def _timed(
    patch: pytest.MonkeyPatch, owner: Any, name: str, into: list[float] | None, starts: list[float] | None = None,
    ends: list[float] | None = None,
) -> None:
    """Wrap `owner.name` so each call's seconds are appended to `into`, its start to `starts`, its end to `ends`."""
    inner = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        if starts is not None:
            starts.append(start)
        try:
            return inner(*args, **kwargs)
        finally:
            end = time.perf_counter()
            if into is not None:
                into.append(end - start)
            if ends is not None:
                ends.append(end)

    patch.setattr(owner, name, timed)


def generate_steps(steps: int = 400, rounds: int = 3, prompt: int = 8, batch: int = 1) -> dict[str, Any]:
    """Whole `generate` steps: the step (one `prepare_inputs_for_generation` start to the next) and its parts, min,
    p10 and median microseconds over `rounds` calls of `steps` new tokens (the first 3 steps of each left out: the
    prefill's, the eager warm-up's and the capture's)."""
    from transformers import CompileConfig, LogitsProcessorList, StoppingCriteriaList
    from transformers.generation import utils as generation_utils

    from hf_loopcache.models import _common

    patch = pytest.MonkeyPatch()
    helpers.stand_in_graphs(patch)
    model = _model()
    config = CompileConfig()
    config._compile_all_devices = True  # transformers' switch to take the compiled call off CUDA
    cache = FullLoopCache(model, static=True, max_batch_size=batch, max_cache_len=prompt + steps + 4)
    ids = torch.randint(3, 60, (batch, prompt))
    mask = torch.ones(batch, prompt, dtype=torch.long)
    gen = dict(attention_mask=mask, cache=cache, do_sample=False, compile_config=config, pad_token_id=0)
    model.generation_config.max_length = None  # (the tiny config's 512 positions: no warning for longer runs)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, **gen)  # prefill, warm-up, capture
        entry = next(e for e in cache._graphs.values() if e is not None)
        entry.logits.zero_()
        entry.logits[..., 5] = 1.0  # a fixed argmax that is not eos: every call runs all its steps
        runs: dict[str, dict[str, list[float]]] = {}
        for split in (False, True):
            parts: dict[str, list[float]] = defaultdict(list)
            stamps: list[float] = []
            replays: list[float] = []
            synced: list[float] = []
            entry.graph.replay = functools.partial(_stamp, replays)  # the host side only
            with pytest.MonkeyPatch.context() as timing:
                _timed(timing, model, "prepare_inputs_for_generation", parts["prepare_inputs_for_generation"], stamps)
                _timed(timing, generation_utils.StopCheck, "__call__", parts["stop check (host sync)"], ends=synced)
                if split:
                    _timed(timing, DecodeGraphs, "__call__", parts["forward (DecodeGraphs)"])
                    _timed(timing, model, "_update_model_kwargs_for_generation",
                           parts["_update_model_kwargs_for_generation"])
                    _timed(timing, LogitsProcessorList, "__call__", parts["logits processors"])
                    _timed(timing, _common._NonFiniteLogits, "__call__", parts["  of which _NonFiniteLogits"])
                    _timed(timing, StoppingCriteriaList, "__call__", parts["stopping criteria"])
                for _ in range(rounds):
                    cache.reset()
                    first, replayed, stopped = len(stamps), len(replays), len(synced)
                    model.generate(ids, max_new_tokens=steps, **gen)
                    parts["step"] += [b - a for a, b in zip(stamps[first + 3 :], stamps[first + 4 :])]
                    # stop check j (step j's, after the prefill's at j = 0) returns, then step j + 1 replays
                    pairs = list(zip(synced[stopped:], replays[replayed:]))[3:]
                    parts["exposed: stop check -> replay"] += [r - s for s, r in pairs]
                    parts["overlapped: replay -> stop check"] += [
                        s - r for r, s in zip(replays[replayed:], synced[stopped + 1 :])
                    ][3:]
            runs["split" if split else "whole"] = parts
    patch.undo()
    whole = {name: _stats(runs["whole"][name]) for name in ("step", "exposed: stop check -> replay",
                                                            "overlapped: replay -> stop check")}
    split = {name: _stats(per) for name, per in runs["split"].items()}
    named = [name for name in split if name != "step" and name[0] != " " and ":" not in name]
    medians = sum(split[name]["median_us"] for name in named)
    split["rest of _sample's loop"] = {"median_us": round(split["step"]["median_us"] - medians, 1)}
    print(f"{len(cache.cells)} cells, batch {batch}, prompt {prompt}, {rounds} x {steps} steps; host us per generate "
          f"step: min {whole['step']['min_us']:.1f}, p10 {whole['step']['p10_us']:.1f}, "
          f"median {whole['step']['median_us']:.1f}")
    for name in ("exposed: stop check -> replay", "overlapped: replay -> stop check"):
        print(f"  {name:40s} " + "  ".join(f"{k[:-3]} {v:7.1f}" for k, v in whole[name].items()))
    print("split (each part timed on its own; the rest is the step's median less the parts' medians):")
    for name, row in split.items():
        print(f"  {name:40s} " + "  ".join(f"{k[:-3]} {v:7.1f}" for k, v in row.items()))
    return {"cells": len(cache.cells), "batch": batch, "prompt": prompt, "generate": whole, "split": split}


_VIEWS = frozenset(("slice", "select", "view", "alias", "as_strided", "expand", "unsqueeze", "squeeze", "t",
                    "transpose", "_reshape_alias", "detach", "reshape", "_unsafe_view", "lift_fresh", "unflatten"))


def generate_ops(prompt: int = 8, batch: int = 1) -> dict[str, list[str]]:
    """The torch ops (aten, views left out) of one steady `generate` step outside the replayed graph, in order: those
    after the replay up to the stop check (a GPU runs them after the graph; the host launches them while it runs),
    and those from the stop check (whose host read waits for the device) up to the next replay (the GPU waits)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import CompileConfig
    from transformers.generation import utils as generation_utils

    log: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            log.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    patch = pytest.MonkeyPatch()
    helpers.stand_in_graphs(patch)
    model = _model()
    config = CompileConfig()
    config._compile_all_devices = True
    cache = FullLoopCache(model, static=True, max_batch_size=batch, max_cache_len=prompt + 16)
    ids = torch.randint(3, 60, (batch, prompt))
    gen = dict(attention_mask=torch.ones(batch, prompt, dtype=torch.long), cache=cache, do_sample=False,
               compile_config=config, pad_token_id=0)
    inner = generation_utils.StopCheck.__call__

    def stop(self: Any, *args: Any) -> Any:
        log.append("<read>")
        return inner(self, *args)

    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, **gen)
        entry = next(e for e in cache._graphs.values() if e is not None)
        entry.logits.zero_()
        entry.logits[..., 5] = 1.0
        entry.graph.replay = functools.partial(log.append, "<replay>")
        patch.setattr(generation_utils.StopCheck, "__call__", stop)
        cache.reset()
        with Ops():
            model.generate(ids, max_new_tokens=12, **gen)
    patch.undo()
    step = " ".join(log).split("<replay>")[6].split()  # from one replay to the next
    read = step.index("<read>")
    out = {
        "after the replay (GPU: after the graph)": [op for op in step[:read] if op not in _VIEWS],
        "the stop check (its host read) to the next replay (GPU idle)": [op for op in step[read + 1 :] if op not in _VIEWS],
    }
    for name, ops in out.items():
        print(f"{name}: {len(ops)} ops: {' '.join(ops)}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generate", action="store_true", help="whole generate steps, split by call")
    parser.add_argument("--steps", type=int, default=400, help="new tokens per generate call (--generate)")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (--generate)")
    parser.add_argument("--ops", action="store_true", help="list the torch ops of a generate step outside the graph")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    out = {"call": main()}
    if args.generate:
        out["generate"] = generate_steps(steps=args.steps, prompt=args.prompt)
    if args.ops:
        out["ops"] = generate_ops(prompt=args.prompt)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
