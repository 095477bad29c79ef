"""The [perf] suite in time-boxed parts: `python -m benchmarks.run suite --part PART --budget-s N --prefix NAME`.

Parts (each writes `benchmarks/results/<prefix>_<file>.json` row by row, so a part stopped by its time keeps what
finished; the rows carry the GPU and versions in the file's header):

- `generate`: `model.generate` decode at 8K, batch 1 and 8, every looped cache static with the captured step (`graph`
  mode of `bench_generate`) on Ouro-1.4B's shape, full and RIPE(64) on Huginn-0125's (`_generate_ouro`,
  `_generate_huginn`);
- `capacity`: the largest batch by search in a stated memory budget beside the one predicted from stored bytes
  (`bench_capacity`), Ouro-1.4B's shape at 8K and 32K (full, RIPE(64), kivi4-share, hand), Huginn-0125's at 8K (full,
  RIPE(64)); decode tok/s at the largest batch with the captured step for full and hand (Ouro) and full and RIPE(64)
  (Huginn) (`_capacity_ouro_8k`, `_capacity_huginn_8k`, `_capacity_ouro_32k`, in that order; stated budgets 24, 32 and
  32 GiB, `--capacity-budget-gib` sets one for all);
- `contexts`: the `generate` rows at 16K and 32K (full and hand; batch 1 and 8: a static cache that does not fit is
  an `oom` row with the GPU's free memory at its start) (`_contexts`);
- `peers`: transformers' caches on the plain Qwen2 peer of Ouro-1.4B's width and slot count (96 layers), at 8K, batch
  1 and 8: `DynamicCache`, `StaticCache` with transformers' own compiled decode step (its `CompileConfig` in the rows),
  `QuantizedCache` (the first backend that builds: quanto, hqq, fp8; `unavailable` with the reasons otherwise)
  (`_peers`). With `--peers-after FILE` it builds and compiles first, then waits for FILE before its timed rows: run
  it in the background beside `all`, which touches FILE (`--release FILE`) when its own rows are done;
- `all`: `generate`, `capacity`, `contexts` in turn, each ending by its share of `--budget-s` (time a part leaves
  unused goes to the next).

Every part times decode per step within one run (`--timing steps`: a logits processor that records a CUDA event per
token, so the clock adds no host sync and a step is the one a user's `generate` runs; the rows give the mean and the
median step; up to session 20 the processor synchronised at each token, `--timing steps-sync`, which counted the host
work between the processors and transformers' stop check in every step) and warms a static cache up from a 320-token prompt (the captured or compiled step depends
on the cache's shape only; 320 tokens pass the LoopKV presets' sink and window, so a page is coded and its kernels
compile), so a row costs one full prefill. A manifest `<prefix>_suite_<part>.json` records each part's command line and seconds. `--tiny` runs the
same parts at micro shapes on the CPU (the suite's own check; numbers mean nothing there).

On one H200 (see the README's benchmark section for the exact call):

    rm -f /tmp/s12_go
    timeout 560 python -m benchmarks.run suite --part peers --prefix s12 --peers-after /tmp/s12_go --budget-s 545 &
    python -m benchmarks.run suite --part all --prefix s12 --budget-s 450 --release /tmp/s12_go
    wait
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import bench_capacity, bench_generate, common

PARTS = ("generate", "capacity", "contexts", "peers", "all")
#: shares of `--budget-s` of the parts run by `all`, in order
ALL_SHARES = {"generate": 0.33, "capacity": 0.45, "contexts": 0.22}
RUN_NAMES = {"benchmarks.bench_generate": "generate", "benchmarks.bench_capacity": "capacity"}
LOOPED_CACHES = ("full", "ripe64", "deepest", "kivi4", "kivi4-vp", "kivi4-share", "hand")


def _settings(tiny: bool) -> dict[str, Any]:
    """Shapes, contexts and budgets of the parts: the real ones (H200), or micro ones on the CPU (`--tiny`)."""
    if tiny:
        return dict(device="cpu", dtype="float32", ouro="micro-ouro", huginn="micro-huginn", context=96,
                    long=[160, 320], new_tokens=4, capacity_contexts=[96, 160], warmup_prompt=8,
                    budget_gib={"ouro_8k": 0.02, "huginn_8k": 0.02, "ouro_32k": 0.02})
    # stated memory budgets of the capacity searches: small enough that a probe's prefill (batch x context tokens)
    # stays seconds; Huginn-0125's full cache holds 21 GiB per row at 8K, Ouro-1.4B's 24 GiB at 32K, so those get 32
    return dict(device="cuda", dtype="bfloat16", ouro="ouro-1.4b", huginn="huginn-0125", context=8192,
                long=[16384, 32768], new_tokens=32, capacity_contexts=[8192, 32768], warmup_prompt=320,
                budget_gib={"ouro_8k": 24.0, "huginn_8k": 32.0, "ouro_32k": 32.0})


def commands(part: str, prefix: str, budget_s: float, *, tiny: bool = False, peers_after: str | None = None,
             capacity_budget_gib: float | None = None) -> list[tuple[str, Any, list[str], float]]:
    """The runs of one part: (name, module, argv, share of the part's seconds)."""
    s = _settings(tiny)
    common_args = ["--device", s["device"], "--dtype", s["dtype"]]
    steps = ["--timing", "steps", "--warmup-prompt", str(s["warmup_prompt"])]
    if part == "generate":
        gen = ["--modes", "graph", "--batches", "1", "8", "--context", str(s["context"]),
               "--new-tokens", str(s["new_tokens"]), *steps, *common_args]
        return [
            ("generate_ouro", bench_generate, ["--shapes", s["ouro"], "--caches", *LOOPED_CACHES, *gen,
                                               "--out", f"{prefix}_generate_ouro"], 0.7),
            ("generate_huginn", bench_generate, ["--shapes", s["huginn"], "--caches", "full", "ripe64", *gen,
                                                 "--out", f"{prefix}_generate_huginn"], 0.3),
        ]
    if part == "contexts":
        return [("contexts", bench_generate, ["--shapes", s["ouro"], "--caches", "full", "hand", "--modes", "graph",
                                              "--batches", "1", "8", "--context", *map(str, s["long"]),
                                              "--new-tokens", str(s["new_tokens"] // 2), *steps, *common_args,
                                              "--out", f"{prefix}_contexts"], 1.0)]
    if part == "peers":
        argv = ["--shapes", s["ouro"], "--peers-only", "--peers", "dynamic", "static", "quantized",
                "--batches", "1", "8", "--context", str(s["context"]), "--new-tokens", str(s["new_tokens"]), *steps,
                *common_args, "--out", f"{prefix}_peers"]
        if peers_after:
            argv += ["--peers-after", peers_after, "--peers-wait-s", str(budget_s)]
        return [("peers", bench_generate, argv, 1.0)]
    if part == "capacity":
        budgets = {k: capacity_budget_gib if capacity_budget_gib is not None else v for k, v in s["budget_gib"].items()}

        def cap(piece: str, probes: int) -> list[str]:
            return ["--new-tokens", "8", "--budget-gib", str(budgets[piece]), "--resolution", "0.1", "--max-probes",
                    str(probes), "--share-time", "--throughput", "graph", "--throughput-tokens", "16", *common_args,
                    "--out", f"{prefix}_capacity_{piece}"]

        short, long = (str(c) for c in s["capacity_contexts"])
        ouro = ["--shapes", s["ouro"], "--caches", "full", "hand", "ripe64", "kivi4-share",
                "--throughput-caches", "full", "hand"]
        return [
            # Huginn-0125's prefill costs about 1.8 s per 8K row (H200): its searches get the largest share
            ("capacity_ouro_8k", bench_capacity, [*ouro, "--contexts", short, *cap("ouro_8k", 4)], 0.34),
            ("capacity_huginn_8k", bench_capacity, ["--shapes", s["huginn"], "--caches", "full", "ripe64",
                                                    "--throughput-caches", "full", "ripe64", "--contexts", short,
                                                    *cap("huginn_8k", 2)], 0.36),
            ("capacity_ouro_32k", bench_capacity, [*ouro, "--contexts", long, *cap("ouro_32k", 3)], 0.30),
        ]
    raise SystemExit(f"--part must be one of {PARTS}, got {part!r}")


def run_part(part: str, prefix: str, budget_s: float, runs: list[dict] | None = None, **kw: Any) -> list[dict]:
    """Run one part's commands in turn, each with `--deadline-s` at its cumulative share of `budget_s`; each is
    appended to `runs` before it starts (its seconds once it ends), so a part stopped midway still names its command."""
    runs = [] if runs is None else runs
    start = time.perf_counter()
    share = 0.0
    for name, module, argv, fraction in commands(part, prefix, budget_s, **kw):
        share += fraction
        left = start + share * budget_s - time.perf_counter()
        full = [*argv, "--deadline-s", str(round(max(1.0, left), 1))]
        command = f"python -m benchmarks.run {RUN_NAMES[module.__name__]} {' '.join(full)}"
        print(f"[suite] {part}/{name}: {command}", flush=True)
        entry = {"name": name, "module": module.__name__, "argv": full, "command": command, "seconds": None}
        runs.append(entry)
        t = time.perf_counter()
        module.main(full)
        entry["seconds"] = round(time.perf_counter() - t, 1)
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True, choices=PARTS, help="which part of the suite")
    parser.add_argument("--budget-s", type=float, required=True, help="seconds the part (or `all`) may take")
    parser.add_argument("--prefix", default="suite", help="result files: benchmarks/results/<prefix>_*.json")
    parser.add_argument("--peers-after", default=None, metavar="FILE",
                        help="peers: compile first, then wait for FILE before the timed rows")
    parser.add_argument("--release", default=None, metavar="FILE", help="touch FILE when the part is done")
    parser.add_argument("--capacity-budget-gib", type=float, default=None,
                        help="capacity's stated memory budget for every search (default on the GPU: 24 GiB for Ouro "
                             "at 8K, 32 GiB for Huginn at 8K and Ouro at 32K)")
    parser.add_argument("--tiny", action="store_true", help="micro shapes on the CPU: the suite's own check")
    args = parser.parse_args(argv)
    # `timeout` (or the device's limit) sends SIGTERM: leave through `finally` (manifest, release file) with the rows
    # each benchmark has already written
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.budget_s <= 0:
        raise SystemExit(f"--budget-s must be > 0, got {args.budget_s}")
    kw = dict(tiny=args.tiny, peers_after=args.peers_after, capacity_budget_gib=args.capacity_budget_gib)
    start = time.perf_counter()
    runs: list[dict] = []
    try:
        if args.part == "all":
            elapsed = 0.0
            for part, fraction in ALL_SHARES.items():
                # a part's budget: its share plus what the parts before it left unused
                elapsed_now = time.perf_counter() - start
                budget = max(1.0, fraction * args.budget_s + (elapsed - elapsed_now))
                run_part(part, args.prefix, budget, runs, **kw)
                elapsed += fraction * args.budget_s
        else:
            run_part(args.part, args.prefix, args.budget_s, runs, **kw)
    finally:
        if args.release:
            Path(args.release).touch()
        manifest = common.RESULTS / f"{args.prefix}_suite_{args.part}.json"
        common.RESULTS.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({"environment": common.environment(), "part": args.part,
                                        "budget_s": args.budget_s, "seconds": round(time.perf_counter() - start, 1),
                                        "runs": runs}, indent=2) + "\n")
        print("wrote", manifest, flush=True)


if __name__ == "__main__":
    main()
