"""Plot `benchmarks.run generate` results: decode tokens/s and peak memory per cache and batch.

`python -m benchmarks.plot_generate benchmarks/results/<name>.json [...] --out benchmarks/results/<name>.png`; a
configuration found in several files is drawn from the last file that has it. `<name>.json=LABEL` adds LABEL to the
names of that file's rows (an A/B whose two sides ran as two processes, e.g. one with a change patched out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _name(row: dict) -> str:
    """The cache, with its mode when it is not the growable cache's eager decoding (`static`, `graph`), "op by op"
    for rows run without the fused layer kernels (`--fused off`) and "no one-launch read" for rows run without
    `coded_attention`'s one-launch read (`--one-launch off`), "no whole-source read" for deepest-plane rows run
    without it (`--whole-source off`)."""
    mode = row.get("mode")
    name = row["cache"] if mode in (None, "eager", "peer") else f"{row['cache']} ({mode})"
    name += ", op by op" if row.get("fused_ops") is False else ""
    name += ", no whole-source read" if row.get("whole_source") is False and row["cache"] == "deepest" else ""
    return name + (", no one-launch read" if row.get("one_launch") is False else "")


def _rows(results: list[str]) -> list[dict]:
    """The rows to draw from `results` (`path` or `path=LABEL`): a configuration measured in several files is drawn
    from the later file; a LABEL is added to its file's cache names."""
    latest: dict[tuple, dict] = {}
    for f in results:
        f, _, label = f.partition("=")
        for r in json.loads(Path(f).read_text())["rows"]:
            if r.get("status") == "ok":
                r = {**r, "cache": f"{r['cache']}, {label}"} if label else r
                latest[(r["shape"], r["model"], _name(r), r["batch"], r["context"])] = r
    return list(latest.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", help="result JSON files written by `benchmarks.run generate`")
    parser.add_argument("--out", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(args.results)
    shapes = sorted({r["shape"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    longest = {shape: max(r["context"] for r in rows if r["shape"] == shape) for shape in shapes}
    n_rows = 3 if len(contexts) > 1 else 2
    fig, axes = plt.subplots(n_rows, len(shapes), figsize=(6 * len(shapes), 4 * n_rows), squeeze=False)
    for col, shape in enumerate(shapes):
        # the bars: one context per shape (the first of the run), tok/s and peak memory per batch
        context = min(r["context"] for r in rows if r["shape"] == shape)
        mine = [r for r in rows if r["shape"] == shape and r["context"] == context]
        labels = sorted({(r["model"], _name(r)) for r in mine})
        batches = sorted({r["batch"] for r in mine})
        width = 0.8 / max(1, len(labels))
        for i, (model, cache) in enumerate(labels):
            name = cache if model == "looped" else f"{cache} (plain peer)"
            for row_idx, key in enumerate(("decode_tokens_per_s", "peak_memory_gib")):
                xs, ys = [], []
                for j, b in enumerate(batches):
                    hit = [r for r in mine if r["batch"] == b and (r["model"], _name(r)) == (model, cache)]
                    if hit and hit[0].get(key) is not None:
                        xs.append(j + i * width)
                        ys.append(hit[0][key])
                axes[row_idx][col].bar(xs, ys, width, label=name)
        for row_idx, title in enumerate(("decode tokens/s", "peak GPU memory (GiB)")):
            ax = axes[row_idx][col]
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
            ax.set_title(f"{shape}, {context} context: {title}")
            ax.legend(fontsize=7)
        if n_rows == 3:  # ms per decode step against context, batch 1 (or the smallest batch run)
            ax = axes[2][col]
            rows_shape = [r for r in rows if r["shape"] == shape]
            b0 = min(r["batch"] for r in rows_shape)
            for model, cache in sorted({(r["model"], _name(r)) for r in rows_shape}):
                pts = sorted((r["context"], r["ms_per_decode_step"]) for r in rows_shape
                             if r["batch"] == b0 and (r["model"], _name(r)) == (model, cache))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=cache if model == "looped" else f"{cache} (plain peer)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"context (tokens, up to {longest[shape]})")
            ax.set_ylabel("ms / decode step")
            ax.set_title(f"{shape}, batch {b0}: ms per step against context")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
