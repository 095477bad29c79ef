"""What a CUDA graph's launch costs a step that starts from an idle GPU, by kernel count and by chunks.

A `generate` step replays the captured forward after the previous step's stop check has synchronised, so the GPU is
idle while the host launches the graph. Here: a chain of `n` tiny kernels (in-place adds on a 4 KiB tensor) captured
as one graph or as `k` graphs of `n / k` kernels each (one memory pool, replayed in order); per setting the time of
a replay from an idle GPU (a sync before and after, median of 30), of replays back to back (per replay, 30 in a
row, one sync) and the host time of the launch calls; the tensor's final value checks that every replay ran every
kernel. The idle-start time minus the back-to-back time is the launch
latency the GPU waits for.

    python -m benchmarks.bench_graph_launch --kernels 250 1000 2000 --chunks 1 2 4 8 --out graph_launch_h200
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks.common import RESULTS, environment


def _capture(n: int, k: int, x: torch.Tensor) -> list[Any]:
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    per = -(-n // k)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up as capture wants it
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for i in range(0, n, per):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            for _ in range(min(per, n - i)):
                x.add_(1.0)
        graphs.append(g)
    return graphs


def measure(n: int, k: int, reps: int = 30) -> dict[str, Any]:
    x = torch.zeros(1024, device="cuda")
    graphs = _capture(n, k, x)

    def replay() -> None:
        for g in graphs:
            g.replay()

    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        replay()
    torch.cuda.synchronize()
    b2b = (time.perf_counter() - t0) / reps
    idle, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        idle.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    idle.sort()
    host.sort()
    torch.cuda.synchronize()
    if float(x[0]) != 3 + n * (3 + 2 * reps):  # every replay ran every kernel of every chunk
        raise RuntimeError(f"{k} graphs of {n} kernels replayed {float(x[0])} adds, not {3 + n * (3 + 2 * reps)}")
    return {"kernels": n, "chunks": k, "back_to_back_us": round(1e6 * b2b, 1),
            "from_idle_us": round(1e6 * idle[reps // 2], 1), "launch_host_us": round(1e6 * host[reps // 2], 1),
            "exposed_us": round(1e6 * (idle[reps // 2] - b2b), 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", type=int, default=[250, 1000, 2000])
    parser.add_argument("--chunks", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--out", default="graph_launch")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_graph_launch times CUDA graphs: it needs a GPU")
    rows = []
    for n in args.kernels:
        for k in args.chunks:
            rows.append(measure(n, k))
            print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
