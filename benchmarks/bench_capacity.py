"""Capacity: the largest batch that prefills and decodes in a memory budget, beside what the cache's stored bytes predict.

For each shape x context x cache (the caches of `bench_generate.CACHES`):

1. a **batch-1 probe**: `model.generate` of `context - new_tokens` random prompt tokens plus `new_tokens` greedy tokens
   with a fresh cache. It gives the stored bytes per row at the context (`cache.stored_bytes()`, measured; the plan's
   byte model beside it) and the **workspace**: the probe's peak minus the weights and the bytes stored (activations,
   logits, allocator rounding: the memory a generate needs beyond what the cache keeps);
2. the **prediction**: `floor((budget - weights - workspace) / (stored bytes per token x context))` (the workspace
   stated as a constant), and beside it two brackets with a per-row workspace: `floor((budget - weights) / (stored
   bytes per row + workspace))` (all of batch 1's workspace counted per row), and the modelled one,
   `floor((budget - weights - (workspace - row)) / (stored bytes per row + row))`, where `row` is what an exact
   one-pass prefill holds per row beyond the cache (`prefill_row_bytes`: the layer's input and output, one cell's
   prompt keys and values, Huginn's injected embeddings, the RoPE tables; queries, attention, projections and the MLP
   run in pieces of a fixed number of tokens, whose workspace does not grow with the batch); with `--prefill-rows N`
   (the models' `prefill_rows`: the prefill runs the batch's rows in groups of at most N, each group's cells written
   into its rows of the one cache) that per-row workspace is held for one group only (a generate's prefill returns
   nothing per prompt position: logits at the last one, no latent states), so the modelled bracket is
   `floor((budget - weights - (workspace - row) - N x row) / stored bytes per row)`;
3. the **search**: probes at batch b (each a fresh cache; out-of-memory caught as `torch.OutOfMemoryError`; cache,
   outputs and the allocator's cache freed between probes), from the modelled bracket (the nearest: a probe that runs
   out of memory can cost most of a prefill), then up or down by steps that
   double (an eighth of the prediction first), then bisection until the gap between the largest batch that fits
   and the smallest that does not is at most `--resolution` of it. Every probe is recorded: batch, ok / oom, peak
   GiB, stored GiB, seconds, aggregate decode tok/s (the `new_tokens - 1` decode steps, timed on the device by a
   logits processor that synchronises once per step).

The budget is the GPU's memory (`--budget-gib`, default its total), enforced with
`torch.cuda.set_per_process_memory_fraction`, so a run with a smaller stated budget finds the batch that budget holds.
Peaks are `torch.cuda.max_memory_allocated` (reset per probe); on CPU (micro shapes: the benchmark's own check) the
live tensor bytes of `benchmarks.memtrack.LiveBytes`, a peak above the budget counting as out of memory. Each row also reports a straight-line fit of peak against batch over the probes
that fit (`fit_fixed_gib`, `fit_per_row_gib`): the per-row slope minus the stored bytes per row is the transient
that grows with the batch. The result file (`benchmarks/results/<out>.json`) is rewritten after every probe (the row
in progress marked so); `--deadline-s` starts no probe that would end past it (its time estimated as the slowest
prefill seconds per row so far times the batch, plus the slowest decode seconds, plus a quarter), so a run stops
cleanly with what finished; with `--share-time` each row's search gets an equal share of the time left (the rows
after it are not starved by one slow search). Huginn runs with `init_scale=0.0`.

`--throughput graph` (for `--throughput-caches`, default all): after the search, decode tok/s at the largest batch
with the cache built static and the step captured (`graph_throughput`: warm-up and capture from a 320-token prompt,
then a timed generate of `--throughput-tokens` tokens per step; a batch that does not fit static is retried an eighth
lower, at most 3 batches): `graph_at_largest` in the row, beside the eager probes' `decode_tokens_per_s_at_largest`
(growable cache, eager step: bound by the host, not by the batch).

Run on one H200 (a probe costs about its prefill, `batch x context` tokens; a stated budget below the GPU's memory
makes the batches, and so the probes, smaller while measured / predicted stays the quantity of interest). Estimated,
not measured: about 4-5 min for the first, 5-6 for the second, 4-5 for the third (`--deadline-s` bounds each):

    python -m benchmarks.run capacity --shapes ouro-1.4b --contexts 8192 --budget-gib 48 --resolution 0.1 \
        --max-probes 5 --deadline-s 500 --out capacity_ouro_8k
    python -m benchmarks.run capacity --shapes ouro-1.4b --contexts 32768 --budget-gib 48 --resolution 0.1 \
        --max-probes 5 --deadline-s 500 --out capacity_ouro_32k
    python -m benchmarks.run capacity --shapes huginn-0125 --caches full ripe64 --contexts 8192 --budget-gib 64 \
        --resolution 0.1 --max-probes 4 --deadline-s 500 --out capacity_huginn_8k

On CPU (micro shapes, the budget emulated): `--shapes micro-ouro --device cpu --dtype float32 --budget-gib 0.03
--contexts 512`.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from typing import TYPE_CHECKING, Any

import torch
from transformers import LogitsProcessorList

from benchmarks.bench_generate import CACHES
from benchmarks.common import StepClock, build, write_rows
from benchmarks.memtrack import LiveBytes

if TYPE_CHECKING:
    from collections.abc import Callable


DEFAULT_CACHES = ("full", "ripe64", "deepest", "kivi4", "kivi4-share", "hand")
GIB = 2**30
#: hidden states per row and prompt token that a prefill holds beyond the cache and one cell's prompt keys and values:
#: the layer's input and output, and on Huginn the injected embeddings (the bound of `tests/cache/test_memory.py`)
PREFILL_ROW_STATES = {"ouro": 2, "huginn_raven": 3}


def prefill_row_bytes(model: Any, context: int) -> int:
    """Bytes an exact one-pass prefill of `context` tokens holds per row beyond what the cache stores, in the model's
    dtype: `PREFILL_ROW_STATES` hidden states and one cell's keys and values per token, and the RoPE tables (cos and
    sin: `head_dim` each in the model's dtype on Ouro, `head_dim / 2` each in fp32 on Huginn). The rest of a prefill's
    workspace (one piece of `TOKEN_CHUNK` tokens, the logits) does not grow with the batch. Ouro-1.4B at 8K in bf16:
    132 MiB; Huginn-0125: 416 MiB."""
    layout = model.loop_layout
    elem = next(model.parameters()).element_size()
    kv = layout.num_kv_heads * layout.head_dim
    rope = 2 * layout.head_dim * elem if layout.name == "ouro" else layout.head_dim * 4
    return ((PREFILL_ROW_STATES[layout.name] * model.config.hidden_size + 2 * kv) * elem + rope) * context


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def probe(
    model: Any,
    shape: str,
    cache_name: str,
    batch: int,
    context: int,
    new_tokens: int,
    device: str,
    *,
    limit_bytes: int | None = None,
    prefill_rows: int | None = None,
) -> dict:
    """One generate at `batch` rows: `context - new_tokens` prompt tokens, then `new_tokens` greedy tokens, a fresh
    cache. Returns `{"batch", "status": "ok" | "oom", "peak_gib", "stored_gib", "seconds", "decode_tokens_per_s"}`;
    the peak is above what was allocated before the probe (the weights). Off CUDA, a peak above `limit_bytes` counts
    as out of memory (the budget emulated; on CUDA the allocator enforces it). `prefill_rows`: the prefill runs the
    batch's rows in groups of at most this many (the models' `prefill_rows`; None: the whole batch at once)."""
    prompt = context - new_tokens
    extra = {"init_scale": 0.0} if shape.startswith("huginn") else {}
    record: dict[str, Any] = {"batch": batch}
    start = time.perf_counter()
    tracker = LiveBytes() if not device.startswith("cuda") else None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    clock = StepClock(device)

    def generate() -> int:  # its own frame: an out-of-memory traceback holds nothing once it is dropped
        torch.manual_seed(batch)
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)
        cache = CACHES[cache_name](model)
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
            prefill_rows=prefill_rows,
            **extra,
        )
        _sync(device)
        return cache.stored_bytes()

    stored, failed = None, None
    try:
        if tracker is not None:
            tracker.__enter__()
        stored = generate()
    except torch.OutOfMemoryError as err:
        failed = str(err).splitlines()[0][:160]
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    record["status"] = "oom" if failed else "ok"
    if failed:
        record["error"] = failed
    if device.startswith("cuda"):
        record["peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 3)
        # what the allocator held: the budget counts this, not the tensors (fragmentation shows as the difference)
        record["reserved_gib"] = round((torch.cuda.max_memory_reserved() - base) / GIB, 3)
    else:
        record["peak_gib"] = round(tracker.peak / GIB, 6)  # type: ignore[union-attr]
        if not failed and limit_bytes is not None and tracker.peak > limit_bytes:  # type: ignore[union-attr]
            record.update(status="oom", error="peak above the budget (emulated off CUDA)")
            failed = record["error"]
    record["stored_gib"] = None if stored is None else round(stored / GIB, 6)
    record["seconds"] = round(time.perf_counter() - start, 2)
    if not failed and len(clock.times) >= 2:
        decode = clock.times[-1] - clock.times[0]
        record["decode_tokens_per_s"] = round(batch * (len(clock.times) - 1) / decode, 1) if decode > 0 else None
        record["decode_s"] = round(decode, 3)
    free_memory(device)
    return record


def graph_throughput(
    model: Any,
    shape: str,
    cache_name: str,
    batch: int,
    context: int,
    new_tokens: int,
    device: str,
    *,
    warmup_prompt: int = 320,
    max_tries: int = 3,
) -> dict:
    """Decode tok/s at `batch` rows with the cache built static and decoded through `generate`'s captured step
    (`graph` mode of `bench_generate`): a warm-up generate of 2 tokens from a `warmup_prompt`-token prompt (captures
    the step, whose shape is the cache's, not the prompt's; 320 tokens code a LoopKV page, so its kernels compile), `reset()`, then `context - new_tokens` prompt tokens and
    `new_tokens` greedy tokens timed per step (`StepClock`). A batch that runs out of memory (static storage and the
    captured graph's pool come on top of what the search's growable probes held) is retried an eighth lower, at most
    `max_tries` batches. Off CUDA nothing is captured (the static cache decodes eagerly): the code path's check."""
    extra = {"init_scale": 0.0} if shape.startswith("huginn") else {}
    tried = []
    for _ in range(max_tries):
        record: dict[str, Any] = {"batch": batch}
        start = time.perf_counter()
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()

        def run(batch: int = batch) -> tuple[int, float, float, list]:
            torch.manual_seed(batch)
            ids = torch.randint(1, model.config.vocab_size, (batch, context - new_tokens), device=device)
            cache = CACHES[cache_name](model, static=True, max_batch_size=batch, max_cache_len=context)
            short = ids[:, : min(warmup_prompt, ids.shape[1])]
            model.generate(short, attention_mask=torch.ones_like(short), cache=cache, max_new_tokens=2,
                           min_new_tokens=2, do_sample=False, pad_token_id=0, **extra)
            cache.reset()
            clock = StepClock(device)
            model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                           logits_processor=LogitsProcessorList([clock]), **extra)
            _sync(device)
            steps, wall, cpu = clock.decode()
            return steps, wall, cpu, [step["capture_s"] for step in cache.captured_steps()]

        try:
            steps, wall, cpu, captures = run()
            record.update(status="ok", decode_tokens_per_s=round(batch * steps / wall, 1),
                          ms_per_decode_step=round(1000 * wall / steps, 3),
                          cpu_ms_per_decode_step=round(1000 * cpu / steps, 3), captured=bool(captures),
                          capture_s=captures)
        except torch.OutOfMemoryError as err:
            record.update(status="oom", error=str(err).splitlines()[0][:160])
        if device.startswith("cuda"):
            record["peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 3)
            record["reserved_gib"] = round((torch.cuda.max_memory_reserved() - base) / GIB, 3)
        record["seconds"] = round(time.perf_counter() - start, 2)
        free_memory(device)
        tried.append(record)
        if record["status"] == "ok" or batch == 1:
            break
        batch = max(1, batch - max(1, batch // 8))
    return {**tried[-1], "tried": [t["batch"] for t in tried]}


def search(
    try_batch: Callable[[int], dict],
    start: int,
    *,
    resolution: float = 0.03,
    max_probes: int = 12,
    out_of_time: Callable[[int], bool] = lambda batch: False,
    known: dict[int, dict] | None = None,
) -> tuple[int, list[dict]]:
    """The largest batch for which `try_batch(b)["status"] == "ok"`, from `start`: up (or down) by steps that double,
    from an eighth of `start`, until the other side is found; then bisection until `hi - lo <= resolution * lo`
    (`hi` the smallest batch seen failing). `known` holds probes already made (batch -> record). Returns the largest
    batch that fit (0 if none) and the probes made, in order. Stops early after `max_probes` or when
    `out_of_time(batch)` says a probe at `batch` would end past the deadline."""
    seen: dict[int, dict] = dict(known or {})
    probes: list[dict] = []

    def ok(b: int) -> bool | None:
        if b not in seen:
            if len(probes) >= max_probes or out_of_time(b):
                return None
            seen[b] = try_batch(b)
            probes.append(seen[b])
        return seen[b]["status"] == "ok"

    start = max(1, int(start))
    step = max(1, start // 8)
    lo, hi = 0, None  # largest known to fit, smallest known to fail
    first = ok(start)
    if first is None:
        return 0, probes
    if first:
        lo = start
        while hi is None:
            b = lo + step
            result = ok(b)
            if result is None:
                return lo, probes
            if result:
                lo, step = b, step * 2
            else:
                hi = b
    else:
        hi = start
        while lo == 0 and hi > 1:
            b = max(1, hi - step)
            result = ok(b)
            if result is None:
                return lo, probes
            if result:
                lo = b
            else:
                hi, step = b, step * 2
        if lo == 0:
            return 0, probes
    while hi - lo > max(1, math.floor(resolution * lo)):
        b = (lo + hi) // 2
        result = ok(b)
        if result is None:
            break
        if result:
            lo = b
        else:
            hi = b
    return lo, probes


def _fit(probes: list[dict]) -> tuple[float | None, float | None]:
    """Least-squares `peak = fixed + per_row * batch` over the probes that fit (None with fewer than 2 batches)."""
    points = [(p["batch"], p["peak_gib"]) for p in probes if p["status"] == "ok" and p.get("peak_gib") is not None]
    if len({b for b, _ in points}) < 2:
        return None, None
    n = len(points)
    mb, mp = sum(b for b, _ in points) / n, sum(p for _, p in points) / n
    slope = sum((b - mb) * (p - mp) for b, p in points) / sum((b - mb) ** 2 for b, _ in points)
    return round(mp - slope * mb, 3), round(slope, 4)


def run_cache(
    model: Any,
    shape: str,
    cache_name: str,
    context: int,
    *,
    budget_bytes: int,
    weights_bytes: int,
    new_tokens: int,
    device: str,
    resolution: float = 0.03,
    max_probes: int = 12,
    out_of_time: Callable[[float], bool] = lambda seconds: False,
    search_out_of_time: Callable[[float], bool] | None = None,
    progress: Callable[[dict], None] = lambda row: None,
    throughput: str = "eager",
    throughput_tokens: int = 16,
    prefill_rows: int | None = None,
) -> dict:
    """One row: the batch-1 probe, the prediction, the search, the largest batch and its decode tok/s.
    `out_of_time(seconds)` says whether work expected to take `seconds` would end past the deadline (a probe's time
    is estimated from the slowest seconds per row seen so far); `search_out_of_time` the same for the search's probes
    (the row's share of the time: default `out_of_time`); `progress(row)` gets the row after every probe.
    `throughput="graph"`: after the search, decode tok/s at the largest batch with the cache static and the step
    captured (`graph_throughput`, `throughput_tokens` tokens), beside the eager probes' tok/s. `prefill_rows`: every
    probe's prefill runs the batch's rows in groups of at most this many (recorded in the row; the modelled bracket
    counts the per-row prefill workspace for one group)."""
    row: dict[str, Any] = {
        "shape": shape,
        "cache": cache_name,
        "context": context,
        "prompt": context - new_tokens,
        "new_tokens": new_tokens,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "layout": model.loop_layout.describe(),
        "budget_gib": round(budget_bytes / GIB, 3),
        "weights_gib": round(weights_bytes / GIB, 3),
        "prefill_rows": prefill_rows,
    }
    plan = CACHES[cache_name](model).plan
    row["stored_bytes_per_token_model"] = round(
        plan.expected_stored_bytes(context) / context * next(model.parameters()).element_size()
        / plan.layout.bytes_per_element, 1
    )
    if out_of_time(0.0):
        row["status"] = "deadline"
        return row
    limit = budget_bytes - weights_bytes
    # a first batch-1 probe pays Triton's compiles (seconds): untimed, so the deadline's seconds-per-row estimate
    # comes from a warm probe (the first estimate stopped two rows of the H200 run before their first search probe)
    warm = probe(model, shape, cache_name, 1, context, new_tokens, device, limit_bytes=limit, prefill_rows=prefill_rows)
    row["warmup_s"] = warm["seconds"]
    one = warm if warm["status"] != "ok" else probe(model, shape, cache_name, 1, context, new_tokens, device,
                                                   limit_bytes=limit, prefill_rows=prefill_rows)
    row["probe_batch_1"] = one
    if one["status"] != "ok":
        row.update(status="batch 1 does not fit", largest_batch=0, probes=[one])
        return row
    stored_row = one["stored_gib"] * GIB
    workspace = one["peak_gib"] * GIB - stored_row
    row["stored_bytes_per_token"] = round(stored_row / context, 1)
    row["stored_gib_per_row"] = round(stored_row / GIB, 3)
    row["workspace_gib"] = round(workspace / GIB, 3)
    predicted = max(0, math.floor((budget_bytes - weights_bytes - workspace) / stored_row))
    row["predicted_batch"] = predicted
    # the other bracket: the whole batch-1 workspace counted per row
    row["predicted_batch_workspace_per_row"] = max(0, math.floor((budget_bytes - weights_bytes) / (stored_row + workspace)))
    # the modelled bracket: what a prefill holds per row (input, output, a cell's prompt keys and values), the rest of
    # batch 1's workspace once
    per_row = prefill_row_bytes(model, context)
    row["prefill_row_gib_model"] = round(per_row / GIB, 3)
    fixed = max(0.0, workspace - per_row)
    if prefill_rows is not None:  # the per-row prefill workspace is held for one group, not per row of the batch
        fixed += prefill_rows * per_row
        per_row = 0
    row["predicted_batch_row_workspace"] = max(
        0, math.floor((budget_bytes - weights_bytes - fixed) / (stored_row + per_row))
    )
    row["probes"] = [one]
    # a probe's time: its decode steps (about constant in the batch: they wait on the host) plus a prefill that grows
    # with the batch; the slowest seen of each, with a margin
    rate = [one["seconds"] - one.get("decode_s", 0.0), one.get("decode_s", 0.0)]

    def estimate(b: int) -> float:
        return 1.25 * (rate[0] * b + rate[1])

    def try_batch(b: int) -> dict:
        record = probe(model, shape, cache_name, b, context, new_tokens, device, limit_bytes=limit,
                       prefill_rows=prefill_rows)
        decode = record.get("decode_s", 0.0)
        rate[0], rate[1] = max(rate[0], (record["seconds"] - decode) / b), max(rate[1], decode)
        row["probes"].append(record)
        progress(row)
        return record

    cut = []

    def late(b: int) -> bool:
        if (search_out_of_time or out_of_time)(estimate(b)):
            cut.append(b)
            return True
        return False

    largest, _ = search(
        try_batch, max(1, row["predicted_batch_row_workspace"]), resolution=resolution, max_probes=max_probes,
        out_of_time=late, known={1: one}
    )
    probes = row.pop("probes")
    fits = [p for p in probes if p["status"] == "ok"]
    fails = [p["batch"] for p in probes if p["status"] != "ok"]
    best = max(fits, key=lambda p: p["batch"])
    largest = max(largest, best["batch"])  # a search cut short before its first probe still has batch 1
    row.update(
        status="ok" if not cut else f"deadline: the search stopped before a probe at batch {cut[0]}",
        largest_batch=largest,
        smallest_failing_batch=min(fails) if fails else None,
        measured_over_predicted=round(largest / predicted, 3) if predicted else None,
        peak_gib_at_largest=best["peak_gib"],
        decode_tokens_per_s_at_largest=best.get("decode_tokens_per_s"),
        probes=probes,
    )
    row["fit_fixed_gib"], row["fit_per_row_gib"] = _fit(probes)
    if throughput == "graph":
        # a prefill of the largest batch, twice over for a retry: skipped when it would end past the deadline
        if out_of_time(estimate(largest)):
            row["graph_at_largest"] = {"status": "deadline", "batch": largest}
        else:
            row["graph_at_largest"] = graph_throughput(model, shape, cache_name, largest, context, throughput_tokens,
                                                       device)
        progress(row)
    return row


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main` (the suite's tests parse its command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["ouro-1.4b", "huginn-0125"], help="model shapes")
    parser.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES), choices=sorted(CACHES), help="caches")
    parser.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768], help="prompt + new tokens")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per probe (decode timed over n-1)")
    parser.add_argument("--budget-gib", type=float, default=None, help="memory budget (default: the GPU's total)")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no probe after this many seconds")
    parser.add_argument("--resolution", type=float, default=0.03, help="stop bisecting at this gap / largest batch")
    parser.add_argument("--max-probes", type=int, default=12, help="probes per row beyond the batch-1 probe")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype")
    parser.add_argument("--device", default="cuda", help="torch device")
    parser.add_argument("--out", default="capacity", help="result file name under benchmarks/results/")
    parser.add_argument("--throughput", default="eager", choices=("eager", "graph"),
                        help="also measure decode tok/s at the largest batch with the static cache's captured step")
    parser.add_argument("--throughput-caches", nargs="*", default=None,
                        help="caches whose largest batch gets the graph throughput run (default: all of --caches)")
    parser.add_argument("--throughput-tokens", type=int, default=16, help="tokens of the graph throughput run")
    parser.add_argument("--prefill-rows", type=int, default=None,
                        help="run each probe's prefill over groups of at most this many rows (the models' "
                        "`prefill_rows`; default: the whole batch at once)")
    parser.add_argument("--share-time", action="store_true",
                        help="with --deadline-s: each row's search gets an equal share of the time left")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens must be >= 2 (one decode step to time), got {args.new_tokens}")
    if args.max_probes < 1:
        raise SystemExit(f"--max-probes must be >= 1, got {args.max_probes}")
    if args.prefill_rows is not None and args.prefill_rows < 1:
        raise SystemExit(f"--prefill-rows must be a positive int (rows per prefill group), got {args.prefill_rows}")
    if any(c <= args.new_tokens for c in args.contexts):
        raise SystemExit(f"--contexts must each exceed --new-tokens ({args.new_tokens}), got {args.contexts}")
    device = args.device
    t0 = time.perf_counter()

    def out_of_time(seconds: float = 0.0) -> bool:
        return args.deadline_s is not None and time.perf_counter() - t0 + seconds > args.deadline_s

    if device.startswith("cuda"):
        where = torch.device(device)
        if where.index is None:  # `cuda` alone: the current device (the memory-fraction call needs an index)
            where = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(where).total_memory
        budget = int(args.budget_gib * GIB) if args.budget_gib is not None else total
        if budget > total:
            raise SystemExit(f"--budget-gib ({args.budget_gib}) exceeds the GPU's {total / GIB:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(budget / total, where)
    elif args.budget_gib is None:
        raise SystemExit("--budget-gib is required off CUDA (no device memory to read)")
    else:
        budget = int(args.budget_gib * GIB)
    dtype = getattr(torch, args.dtype)
    rows: list[dict] = []
    rows_left = [len(args.shapes) * len(args.contexts) * len(args.caches)]
    for shape in args.shapes:
        if out_of_time():
            break
        model = build(shape, dtype, device)
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        extra = {"init_scale": 0.0} if shape.startswith("huginn") else {}
        warm = torch.randint(1, model.config.vocab_size, (1, 64), device=device)
        model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra)
        free_memory(device)
        if device.startswith("cuda"):
            weights = torch.cuda.memory_allocated()  # weights and buffers as allocated
        for context in args.contexts:
            for cache_name in args.caches:
                share = None
                if args.share_time and args.deadline_s is not None:
                    row_end = time.perf_counter() + max(0.0, args.deadline_s - (time.perf_counter() - t0)) / rows_left[0]

                    def share(seconds: float, row_end: float = row_end) -> bool:
                        return time.perf_counter() + seconds > row_end or out_of_time(seconds)

                rows_left[0] -= 1
                graph = args.throughput == "graph" and (
                    args.throughput_caches is None or cache_name in args.throughput_caches
                )
                row = run_cache(
                    model, shape, cache_name, context, budget_bytes=budget, weights_bytes=weights,
                    new_tokens=args.new_tokens, device=device, resolution=args.resolution,
                    max_probes=args.max_probes, out_of_time=out_of_time, search_out_of_time=share,
                    progress=lambda partial: write_rows(args.out, [*rows, {**partial, "status": "in progress"}]),
                    throughput="graph" if graph else "eager", throughput_tokens=args.throughput_tokens,
                    prefill_rows=args.prefill_rows,
                )
                row["elapsed_s"] = round(time.perf_counter() - t0, 1)
                brief = {k: v for k, v in row.items() if k not in ("probes", "probe_batch_1", "layout")}
                print(brief, flush=True)
                rows.append(row)
                write_rows(args.out, rows)  # row by row: a run stopped by a time limit keeps what finished
        del model
        free_memory(device)
    print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
