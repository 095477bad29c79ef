"""Plots of the suite's results: `python -m benchmarks.plot_suite benchmarks/results/<prefix>_*.json --out X.png`.

One column per model shape, three panels:

1. decode tok/s against batch per cache (log-log): the `generate` rows at the shortest context (batch 1 and 8), and
   the capacity rows' decode at the largest batch with the captured step (`graph_at_largest`, marked with a star),
   joined per cache; transformers' peers dashed;
2. ms per decode step against context for the caches measured at several contexts, batch 1 solid and the largest
   batch run dashed (`generate` and `contexts` rows; a row that ran out of memory is left out and named in the title);
3. capacity: the largest batch measured beside the one predicted from stored bytes, per cache and context.

Suite manifests among the files are skipped; a configuration found in several files is drawn from the last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(decode rows, capacity rows) of the files, the last file's row winning per configuration."""
    decode: dict[tuple, dict] = {}
    capacity: dict[tuple, dict] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data.get("rows", []):
            if "largest_batch" in r or "predicted_batch" in r:
                capacity[(r["shape"], r["cache"], r["context"])] = r
            elif "batch" in r and "context" in r:
                decode[(r["shape"], r.get("model"), r["cache"], r.get("mode"), r["batch"], r["context"])] = r
    return list(decode.values()), list(capacity.values())


def _label(r: dict) -> str:
    return f"{r['cache']} (peer)" if r.get("model") == "plain Qwen2 peer" else r["cache"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", help="result JSON files of the suite (generate, contexts, peers, capacity)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode, capacity = load(args.results)
    ok = [r for r in decode if r.get("status") == "ok"]
    shapes = sorted({r["shape"] for r in decode} | {r["shape"] for r in capacity})
    if not shapes:
        raise SystemExit("no rows in the given files")
    fig, axes = plt.subplots(3, len(shapes), figsize=(6.5 * len(shapes), 13), squeeze=False)
    for col, shape in enumerate(shapes):
        mine = [r for r in ok if r["shape"] == shape]
        # 1. tok/s against batch
        ax = axes[0][col]
        context = min((r["context"] for r in mine), default=None)
        for label in sorted({_label(r) for r in mine}):
            pts = {r["batch"]: r["decode_tokens_per_s"] for r in mine if _label(r) == label and r["context"] == context}
            cap = next((c for c in capacity if c["shape"] == shape and c["cache"] == label and c["context"] == context
                        and (c.get("graph_at_largest") or {}).get("status") == "ok"), None)
            if cap is not None and cap["graph_at_largest"]["batch"] not in pts:
                pts[cap["graph_at_largest"]["batch"]] = cap["graph_at_largest"]["decode_tokens_per_s"]
            if pts:
                xs = sorted(pts)
                line = ax.plot(xs, [pts[x] for x in xs], marker="o", label=label,
                               linestyle="--" if label.endswith("(peer)") else "-")[0]
                if cap is not None:
                    b = cap["graph_at_largest"]["batch"]
                    ax.plot([b], [pts[b]], marker="*", markersize=14, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{shape}, {context} context: tok/s against batch (star: largest batch)")
        ax.legend(fontsize=7)
        # 2. ms per step against context
        ax = axes[1][col]
        b_max = max((r["batch"] for r in mine), default=1)
        failed = sorted({f"{_label(r)} b{r['batch']} {r['context']}" for r in decode
                         if r["shape"] == shape and r.get("status") == "oom"})
        # the caches measured at more than one context (the `contexts` part's), the others at their one point
        spread = sorted(label for label in {_label(r) for r in mine}
                        if len({r["context"] for r in mine if _label(r) == label}) > 1)
        for label in spread:
            for batch, style in ((min(r["batch"] for r in mine), "-"), (b_max, "--")):
                pts = sorted((r["context"], r["ms_per_decode_step"]) for r in mine
                             if _label(r) == label and r["batch"] == batch)
                if len(pts) >= 1:
                    ax.plot(*zip(*pts), marker="o", linestyle=style, label=f"{label}, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms / decode step")
        ax.set_title(f"{shape}: ms per step against context" + (f" (oom: {', '.join(failed)})" if failed else ""),
                     fontsize=9)
        ax.legend(fontsize=6)
        # 3. capacity
        ax = axes[2][col]
        caps = sorted((c for c in capacity if c["shape"] == shape), key=lambda c: (c["context"], c["cache"]))
        names = [f"{c['cache']}\n{c['context']}" for c in caps]
        xs = range(len(caps))
        ax.bar([x - 0.2 for x in xs], [c.get("predicted_batch") or 0 for c in caps], 0.4, label="predicted")
        cut = [str(c.get("status", "")).startswith("deadline") for c in caps]
        done = [x for x, short in zip(xs, cut) if not short]
        ax.bar([x + 0.2 for x in done], [caps[x].get("largest_batch") or 0 for x in done], 0.4, label="measured")
        short = [x for x, c in zip(xs, cut) if c]
        if short:  # a search stopped by its time: its batch is a lower bound, not a result
            ax.bar([x + 0.2 for x in short], [caps[x].get("largest_batch") or 0 for x in short], 0.4, fill=False,
                   hatch="//", label="search cut short (lower bound)")
        ax.set_xticks(list(xs), names, fontsize=7)
        budget = sorted({c.get("budget_gib") for c in caps if c.get("budget_gib") is not None})
        ax.set_title(f"{shape}: largest batch in {', '.join(map(str, budget)) or '?'} GiB")
        ax.set_ylabel("batch")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
