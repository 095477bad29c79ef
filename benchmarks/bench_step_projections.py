"""The projections of a decode step timed where they run: back to back in one CUDA graph, as in a captured step.

`bench_gemv` times one call at a time with L2 flushed, which is how `GEMV_CONFIGS` was picked. In a step the
projections run between other kernels with nothing flushed, and the in-step profile disagreed with the isolated
timings (cuBLAS's gate/up at 3.4 TB/s in the step, 2.3 for the Triton GEMV). This benchmark replays the
token-wise half of an Ouro-1.4B-shaped step (per layer: stacked q/k/v, a stand-in for attention that passes the
queries on, `o_proj`, the residual norm pair, stacked gate/up, the gated down projection, the norm pair into the next
layer; distinct weights per layer, so every projection reads its weight from HBM as in the step) captured in one
graph, and reports microseconds per layer:

- `step`: the models' routing (`hf_loopcache.models._common.linear`: the table, else cuBLAS; the gated down
  projection as `silu_linear` runs it);
- one row per projection and candidate: the step with that projection alone run by cuBLAS or by the GEMV kernel
  at the candidate's settings (the difference to `step` is what the projection's setting is worth per layer call;
  times 96 for an Ouro-1.4B step);
- with `--norm-warps`, one row per setting of the norm kernel's warps (`triton_ops.fused.NORM_TUNING`): the step
  with both norm pairs of every layer launched so.

    python -m benchmarks.bench_step_projections [--rows 1] [--layers 24] [--out step_projections_h200] [--quick]
        [--norm-warps 1 2 4 8] [--only qkv ...]
    python -m benchmarks.bench_step_projections --device cpu --layers 2 --quick   # the script (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.common import write_rows

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down_proj")


def ouro_shapes() -> dict[str, tuple[int, int]]:
    """`name -> (N, K)` of an Ouro-1.4B layer's decode projections (stacked as the model runs them)."""
    from benchmarks.bench_gemv import model_shapes

    shapes = model_shapes()
    return {name: shapes[f"ouro.{name}"] for name in PROJECTIONS}


def fma_candidates(m: int, quick: bool = False) -> list[dict[str, Any]]:
    """FMA settings for `m` rows whose fp32 accumulator (`m x block_n x block_k` values over the program's threads)
    stays at most 64 values per thread; K split by the default rule (none at Ouro-1.4B's shapes and these tiles:
    their feature blocks alone fill the device)."""
    found = []
    for bn, bk, nw in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8)):
        if m * bn * bk > 64 * 32 * nw or (quick and nw != 4):
            continue
        found.append({"block_n": bn, "block_k": bk, "dot": False, "num_warps": nw, "num_stages": 2, "split": None})
    return found


class Layers:
    """Distinct weights of `layers` layers (bf16, scaled so activations stay O(1)) and the norms' weights."""

    def __init__(self, layers: int, m: int, device: str, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        shapes = ouro_shapes()
        self.weights = [
            {name: (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype) for name, (n, k) in
             shapes.items()}
            for _ in range(layers)
        ]  # fmt: skip
        hidden = shapes["o_proj"][0]
        self.norms = [torch.ones(hidden, device=device, dtype=dtype) for _ in range(4)]
        self.x = torch.randn(m, 1, hidden, device=device, generator=gen).to(dtype)
        self.hidden = hidden


def _project(how: Any, x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """`x @ w.T` (`gated`: of `silu(gate) * up`) by `how`: "step" (the models' routing), "cublas", or a settings
    dict for the GEMV kernel."""
    from triton_ops import fused
    from triton_ops.gemv import ops

    if how == "step":
        return ops.silu_linear(x, w) if gated else ops.linear(x, w)
    if how == "cublas":
        if gated:
            k = w.shape[1]
            x = fused.silu_mul(x[..., :k], x[..., k:])
        return torch.nn.functional.linear(x, w)
    x2 = x.reshape(-1, x.shape[-1])
    cfg = {**ops.gemv_config(x2.shape[0], w.shape[0], w.shape[1], ops._sms(x)), **how}
    return ops._gemv_fwd(x2, w, None, cfg, ops._sms(x), gated).view(*x.shape[:-1], w.shape[0])


def run_layers(net: Layers, plan: dict[str, Any]) -> torch.Tensor:
    """The token-wise half of every layer of `net` with each projection run as `plan` says (default "step")."""
    from triton_ops import fused

    w1, w2, w3, w4 = net.norms
    x = net.x
    normed = fused.rms_norm(x, w1, 1e-6)
    for weights in net.weights:
        qkv = _project(plan.get("qkv", "step"), normed, weights["qkv"])
        attn = qkv[..., : net.hidden]  # (attention's output stand-in: the queries, a strided view as in the step)
        o = _project(plan.get("o_proj", "step"), attn, weights["o_proj"])
        h, normed = fused.rms_norm_pair(o, w2, 1e-6, w3, 1e-6, add_after=x)
        gate_up = _project(plan.get("gate_up", "step"), normed, weights["gate_up"])
        down = _project(plan.get("down_proj", "step"), gate_up, weights["down_proj"], gated=True)
        x, normed = fused.rms_norm_pair(down, w4, 1e-6, w1, 1e-6, add_after=h)
    return x


def time_plan(net: Layers, plan: dict[str, Any], device: str, replays: int) -> list[float]:
    """Microseconds per layer of each of `replays` replays (CUDA: the sequence captured in one graph; CPU: one eager
    call)."""
    if device != "cuda":
        start = time.perf_counter()
        run_layers(net, plan)
        return [(time.perf_counter() - start) * 1e6 / len(net.weights)]
    from benchmarks.bench_coded_attention import capture

    graph = capture(lambda: run_layers(net, plan))
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for a, b in events:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    per = [a.elapsed_time(b) * 1e3 / len(net.weights) for a, b in events]
    del graph
    return per


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--only", nargs="*", default=list(PROJECTIONS), choices=PROJECTIONS,
                        help="projections whose settings are swept (none: only the step and the norm rows)")
    parser.add_argument("--norm-warps", nargs="*", type=int, default=[], help="norm kernel warps to sweep")
    parser.add_argument("--quick", action="store_true", help="4-warp candidates only")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="step_projections_h200")
    args = parser.parse_args(argv)
    if args.device == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("`--device cuda` runs the compiled kernels; unset TRITON_INTERPRET")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # (the interpreter has no bf16)
    from triton_ops.fused import NORM_TUNING

    rows: list[dict[str, Any]] = []
    t0 = time.time()
    shapes = ouro_shapes()
    for m in args.rows:
        net = Layers(args.layers, m, args.device, dtype)

        def measure(label: str, plan: dict[str, Any], projection: str | None = None, config: Any = None,
                    m: int = m, net: Layers = net) -> dict[str, Any]:
            per = time_plan(net, plan, args.device, args.replays)
            row = {"rows": m, "layers": args.layers, "variant": label, "projection": projection, "config": config,
                   "us_per_layer": round(statistics.median(per), 3), "us_p20": round(sorted(per)[len(per) // 5], 3),
                   "us_p80": round(sorted(per)[4 * len(per) // 5], 3)}  # fmt: skip
            rows.append(row)
            return row

        base = measure("step", {})
        print(f"M={m} step: {base['us_per_layer']:.2f} us per layer [{time.time() - t0:.0f} s]", flush=True)
        for warps in args.norm_warps:
            before = dict(NORM_TUNING)
            NORM_TUNING["num_warps"] = warps
            try:
                found = measure("norm", {}, "norm", {"num_warps": warps})
            finally:
                NORM_TUNING.update(before)
            print(f"M={m} norm kernel on {warps} warps: {found['us_per_layer']:.2f} us per layer", flush=True)
        for name in args.only:
            n, k = shapes[name]
            found = [measure("cublas", {name: "cublas"}, name, "cublas")]
            for cfg in fma_candidates(m, args.quick):
                try:
                    found.append(measure("gemv", {name: cfg}, name, cfg))
                except Exception as err:  # a setting that does not compile or fit is a result, not a crash
                    rows.append({"rows": m, "variant": "gemv", "projection": name, "config": cfg,
                                 "error": str(err)[:200]})  # fmt: skip
            best = min(found, key=lambda r: r["us_per_layer"])
            print(f"M={m} {name} [{n}x{k}]: step {base['us_per_layer']:.2f}, cublas {found[0]['us_per_layer']:.2f}, "
                  f"best {best['us_per_layer']:.2f} us per layer with {best['config']} [{time.time() - t0:.0f} s]",
                  flush=True)
        write_rows(args.out, rows)
        del net
    path = write_rows(args.out, rows)
    print(f"wrote {path} ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
