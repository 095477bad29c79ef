"""README tables from committed result JSON: `python -m benchmarks.tables benchmarks/results/X.json [...]` prints
markdown (one table per kind of row found: `generate` / `contexts` / `peers` rows, `capacity` rows), each under a line
with the conditions (GPU, versions, date) read from the file's header, so a table in the README is a copy of what
the JSON holds. The warm-up column is a row's untimed first run (Triton compiles, graph capture) or, for the static
peer, transformers' compile of its decode step. A `<prefix>_suite_<part>.json` manifest given among the files adds the reproducing commands.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def conditions(env: dict[str, Any]) -> str:
    """One line: the GPU (or the CPU), torch, transformers, Triton, and the date of the run."""
    parts = [env.get("gpu_name", "CPU"), f"torch {env.get('torch')}", f"transformers {env.get('transformers')}"]
    if env.get("triton"):
        parts.append(f"Triton {env['triton']}")
    if env.get("timestamp"):
        parts.append(env["timestamp"][:16].replace("T", " ") + " UTC")
    return ", ".join(parts)


def _cache_label(row: dict) -> str:
    if row.get("model") == "plain Qwen2 peer":
        backend = f", {row['quantized_backend']}" if row.get("quantized_backend") else ""
        return f"peer: {row['cache']}{backend}"
    return row["cache"] if row.get("mode") in (None, "eager") else f"{row['cache']} ({row['mode']})"


def generate_table(rows: list[dict]) -> list[str]:
    """Decode rows (`bench_generate`): ms per step, tok/s, CPU ms per step, peak memory, stored bytes per token."""
    out = [
        "| shape | cache | batch | context | ms / step | median ms | tok/s | CPU ms / step | peak GiB "
        "| stored B / token | warm-up s | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        status = r.get("status", "-")
        if status not in ("ok", "deadline") and r.get("error"):
            status = f"{status}: {r['error'][:60]}"
        out.append(
            f"| {r['shape']} | {_cache_label(r)} | {_fmt(r.get('batch'))} | {_fmt(r.get('context'))} | "
            f"{_fmt(r.get('ms_per_decode_step'), 2)} | {_fmt(r.get('ms_per_decode_step_median'), 2)} | "
            f"{_fmt(r.get('decode_tokens_per_s'))} | "
            f"{_fmt(r.get('cpu_ms_per_decode_step'), 2)} | {_fmt(r.get('peak_memory_gib'), 2)} | "
            f"{_fmt(r.get('cache_stored_bytes_per_token'), 0)} | "
            f"{_fmt(r.get('compile_warmup_s', r.get('warmup_s')), 1)} | {status} |"
        )
    return out


def capacity_table(rows: list[dict]) -> list[str]:
    """Capacity rows (`bench_capacity`): predicted and measured largest batch, and decode tok/s at the largest."""
    out = [
        "| shape | cache | context | budget GiB | stored KiB / token | predicted | measured | measured / predicted "
        "| peak GiB at largest | eager tok/s at largest | graph batch | graph tok/s | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        graph = r.get("graph_at_largest") or {}
        stored = r.get("stored_bytes_per_token")
        out.append(
            f"| {r['shape']} | {r['cache']} | {_fmt(r['context'])} | {_fmt(r.get('budget_gib'))} | "
            f"{_fmt(None if stored is None else stored / 1024)} | {_fmt(r.get('predicted_batch'))} | "
            f"{_fmt(r.get('largest_batch'))} | {_fmt(r.get('measured_over_predicted'), 2)} | "
            f"{_fmt(r.get('peak_gib_at_largest'), 1)} | {_fmt(r.get('decode_tokens_per_s_at_largest'))} | "
            f"{_fmt(graph.get('batch') if graph.get('status') == 'ok' else None)} | "
            f"{_fmt(graph.get('decode_tokens_per_s'))} | {r.get('status', '-')} |"
        )
    return out


def tables(paths: list[str]) -> str:
    """Markdown for the files, in the order given."""
    lines: list[str] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        name = Path(path).name
        if "runs" in data:  # a suite manifest: the commands that wrote the other files
            lines += [f"Commands of `{name}` (part `{data['part']}`, {data['seconds']} s of {data['budget_s']}):", ""]
            lines += ["```", *(r.get("command") or f"python -m {r['module']} {' '.join(r['argv'])}"
                               for r in data["runs"]), "```", ""]
            continue
        rows = data.get("rows", [])
        if not rows:
            continue
        lines += [f"`{name}`: {conditions(data.get('environment', {}))}", ""]
        if "largest_batch" in rows[0] or "predicted_batch" in rows[0] or "probes" in rows[0]:
            lines += capacity_table(rows)
        else:
            lines += generate_table(rows)
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", help="result JSON files (bench_generate, bench_capacity, suite manifests)")
    args = parser.parse_args(argv)
    print(tables(args.results))


if __name__ == "__main__":
    main()
