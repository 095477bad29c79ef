"""One runner for every benchmark: `python -m benchmarks.run <name> [args]` (`--list` shows the registry).

Each entry names the test module that must pass before its numbers mean anything (STYLE D.22).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from benchmarks.common import environment

REGISTRY = {
    "generate": ("benchmarks.bench_generate", "tests/test_models.py"),
    "capacity": ("benchmarks.bench_capacity", "tests/cache/test_memory.py"),
    "ripe-windows": ("benchmarks.bench_ripe_windows", "tests/cache/test_engine.py"),
    "loopkv-planner": ("benchmarks.bench_loopkv_planner", "tests/planner/test_profile_plan.py"),
    "v-precision": ("benchmarks.bench_v_precision", "tests/cache/test_loopkv.py"),
    "coded-attention": ("benchmarks.bench_coded_attention", "tests/ops/test_coded_attention_kernels.py"),
    "selfspec": ("benchmarks.bench_selfspec", "tests/generation/test_self_speculative.py"),
    "multi-gpu": ("benchmarks.bench_multi_gpu", "tests/cache/test_device_map.py"),
    "flush": ("benchmarks.bench_flush", "tests/ops/test_flush_page.py"),
    "gemv": ("benchmarks.bench_gemv", "tests/ops/test_gemv_kernels.py"),
    "suite": ("benchmarks.suite", "tests/test_bench_suite.py"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", nargs="?", choices=sorted(REGISTRY))
    parser.add_argument("--list", action="store_true")
    args, rest = parser.parse_known_args()
    if args.list or args.name is None:
        for name, (module, test) in REGISTRY.items():
            print(f"{name:12s} {module}  (gate: {test})")
        return
    print("environment:", environment(), flush=True)
    module, _ = REGISTRY[args.name]
    importlib.import_module(module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
