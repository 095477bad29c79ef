"""Where a self-speculative block's time goes, inside the decode as `benchmarks.bench_selfspec --mode graph` runs it:
GPU time per kernel name, per phase (drafts, verification), and what the host does, per block.

Method: per cache, a static cache of bench_selfspec's size (`prompt + (new_tokens + 1) * (gamma + 1)`), one
`self_speculative_generate` call that captures every step (acceptance forced at the family fixture's rate with the
same cache, as bench_selfspec drives it, or `--alpha`; the same seed, so the same blocks every call), `reset()`,
then the same call under `torch.profiler` (CPU and CUDA activity; phase timing on, so a sync and a
`self_speculative::<phase>` range surround each phase) and, unprofiled, the call again timed
(`SpeculativeStats(phase_timing=False)`). Per block (`blocks`: the verifications of the timed call): `wall_ms`
(unprofiled), `gpu_busy_ms` (the union of the kernels' intervals, the prefill's included; kernels that overlap count
once) and `gpu_sum_ms`; per phase (`draft_time_s`: the `gamma` drafts and their rollback; `verify_time_s`: the
verification, acceptance and commit; `prefill_time_s`; `other`: kernels that start outside every range) its wall
time in the profiled run (syncs included), its kernels' GPU time and launches, and the largest kernels (us and
launches per block); host events per block: CUDA runtime calls by name (`cudaGraphLaunch`, `cudaLaunchKernel` for
kernels launched outside a graph, copies and the waits of syncs) and the aten ops with the most host time. A phase's
`wall_ms - gpu_ms` is the time its kernels did not cover (launch and sync gaps, the host).

    python -m benchmarks.profile_selfspec --caches full loopkv-kivi4-share-verify-int4 --batch 8 --out profile_selfspec
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks.bench_selfspec import CACHES, DRAFT_LOOPS, FAMILY, load_acceptance, make_cache, storage_length
from benchmarks.common import RESULTS, build, environment, timed
from benchmarks.profile_step import busy_us
from hf_loopcache import SpeculativeStats, self_speculative_generate


def _events(prof: Any, blocks: int) -> dict[str, Any]:
    """Per block: GPU busy and summed time, and per phase (`self_speculative::<phase>` ranges: the kernels that start
    inside one) its wall time, GPU time and largest kernels; CUDA runtime calls and the aten ops with the most host
    time (self time)."""
    from torch.autograd import DeviceType

    ranges: dict[str, list[tuple[float, float]]] = {}
    gpu, runtime, aten = [], {}, {}
    for e in prof.events():
        a, b = e.time_range.start, e.time_range.end
        if e.name.startswith("self_speculative::"):  # the phase ranges (the profiler shows them on the GPU too)
            if e.device_type != DeviceType.CUDA:
                ranges.setdefault(e.name.split("::", 1)[1], []).append((a, b))
        elif e.device_type == DeviceType.CUDA:
            gpu.append((a, b, e.name[:90]))
        elif e.name.startswith("cuda"):
            slot = runtime.setdefault(e.name, [0.0, 0.0])
            slot[0] += b - a
            slot[1] += 1
        elif e.name.startswith("aten::"):
            slot = aten.setdefault(e.name, [0.0, 0.0])
            slot[0] += e.self_cpu_time_total
            slot[1] += 1
    bounds = sorted((a, b, phase) for phase, spans in ranges.items() for a, b in spans)

    def phase_of(t: float) -> str:
        lo, hi = 0, len(bounds)
        while lo < hi:  # the last range that starts at or before t
            mid = (lo + hi) // 2
            if bounds[mid][0] <= t:
                lo = mid + 1
            else:
                hi = mid
        return bounds[lo - 1][2] if lo and t < bounds[lo - 1][1] else "other"

    kernels: dict[str, dict[str, list[float]]] = {}
    for a, b, name in gpu:
        slot = kernels.setdefault(phase_of(a), {}).setdefault(name, [0.0, 0.0])
        slot[0] += b - a
        slot[1] += 1

    def per_block(table: dict[str, list[float]], n: int) -> list[tuple[str, float, float]]:
        top = sorted(table.items(), key=lambda kv: -kv[1][0])[:n]
        return [(name, round(us / blocks, 1), round(count / blocks, 1)) for name, (us, count) in top]

    phases = {
        phase: dict(
            wall_ms=round(sum(b - a for a, b in ranges.get(phase, [])) / blocks / 1000, 3),
            gpu_ms=round(sum(v[0] for v in table.values()) / blocks / 1000, 3),
            launches=round(sum(v[1] for v in table.values()) / blocks, 1),
            kernels=per_block(table, 16),
        )
        for phase in sorted(set(kernels) | set(ranges))
        for table in [kernels.get(phase, {})]
    }
    return dict(
        gpu_busy_ms=round(busy_us([(a, b) for a, b, _ in gpu]) / blocks / 1000, 3),
        gpu_sum_ms=round(sum(b - a for a, b, _ in gpu) / blocks / 1000, 3),
        phases=phases,
        runtime=per_block(runtime, 12),
        aten=per_block(aten, 20),
    )


def profile_cache(model: Any, name: str, ids: torch.Tensor, *, draft: int, gamma: int, new_tokens: int,
                  alpha: float, kwargs: dict[str, Any]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    length = storage_length(ids.shape[1], new_tokens, gamma)
    cache = make_cache(name, model, gamma, "graph", ids.shape[0], length)
    cuda = ids.is_cuda

    def run(stats: SpeculativeStats | None = None) -> None:
        gen = torch.Generator(device=ids.device).manual_seed(0)
        self_speculative_generate(model, ids, draft_loops=draft, block_size=gamma, max_new_tokens=new_tokens,
                                  cache=cache, speculative_stats=stats, forced_acceptance=alpha, generator=gen,
                                  **kwargs)
        cache.reset()

    run()  # captures every step
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiled = SpeculativeStats()  # phase timing: a sync and a profiler range around each phase
    with profile(activities=activities) as prof:
        timed(lambda: run(profiled), str(ids.device))
    stats = SpeculativeStats(phase_timing=False)
    _, total = timed(lambda: run(stats), str(ids.device))
    blocks = max(1, stats.verifications)
    return dict(
        blocks=stats.verifications,
        wall_ms=round(1000 * stats.decode_time_s / blocks, 3),
        call_s=round(total, 3),
        **_events(prof, max(1, profiled.verifications)),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="ouro-1.4b")
    parser.add_argument("--caches", nargs="+", default=["full", "loopkv-kivi4-share-verify-int4"],
                        choices=sorted(CACHES))  # fmt: skip
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=None,
                        help="forced acceptance of every cache (default: the family fixture's with the same cache, "
                             "from --acceptance-file, as bench_selfspec drives it)")  # fmt: skip
    parser.add_argument("--acceptance-file", default=str(RESULTS / "selfspec_acceptance.json"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="profile_selfspec")
    args = parser.parse_args(argv)
    if args.alpha is not None and not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"`--alpha` must be in [0, 1], got {args.alpha}")
    measured = load_acceptance(args.acceptance_file, args.block_size)
    alphas = {}
    for name in args.caches:
        alphas[name] = args.alpha if args.alpha is not None else measured.get((FAMILY[args.shape], name))
        if alphas[name] is None:
            raise ValueError(f"no measured acceptance for ({FAMILY[args.shape]!r}, {name!r}): pass `--alpha`")
    dev = args.device
    model = build(args.shape, torch.bfloat16 if dev.startswith("cuda") else torch.float32, dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to(dev)
    kwargs = {"init_scale": 0.0} if "huginn" in args.shape else {}
    rows = {}
    with torch.no_grad():
        for name in args.caches:
            rows[name] = profile_cache(model, name, ids, draft=DRAFT_LOOPS[args.shape], gamma=args.block_size,
                                       new_tokens=args.new_tokens, alpha=alphas[name], kwargs=kwargs)  # fmt: skip
            rows[name]["alpha"] = alphas[name]
            r = rows[name]
            print(name, "blocks", r["blocks"], "wall_ms", r["wall_ms"], "gpu_busy_ms", r["gpu_busy_ms"], flush=True)
            for phase, p in r["phases"].items():
                print("  ", phase, "wall_ms", p["wall_ms"], "gpu_ms", p["gpu_ms"], "launches", p["launches"], flush=True)
                for entry in p["kernels"][:6]:
                    print("     ", *entry, flush=True)
    header = dict(shape=args.shape, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens,
                  block_size=args.block_size, draft_loops=DRAFT_LOOPS[args.shape])  # fmt: skip
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(dict(environment=environment(), **header, rows=rows), indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
