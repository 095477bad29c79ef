"""Plot `benchmarks.run generate` results: decode tokens/s and peak memory per cache and batch.

`python -m benchmarks.plot_generate benchmarks/results/<name>.json [...] --out benchmarks/results/<name>.png`
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _name(row: dict) -> str:
    """The cache, with its mode when it is not the growable cache's eager decoding (`static`, `graph`)."""
    mode = row.get("mode")
    return row["cache"] if mode in (None, "eager", "peer") else f"{row['cache']} ({mode})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", help="result JSON files written by `benchmarks.run generate`")
    parser.add_argument("--out", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for f in args.results for r in json.loads(Path(f).read_text())["rows"] if r.get("status") == "ok"]
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
    for col, shape in enumerate(shapes):
        mine = [r for r in rows if r["shape"] == shape]
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
        context = mine[0]["context"]
        for row_idx, title in enumerate(("decode tokens/s", "peak GPU memory (GiB)")):
            ax = axes[row_idx][col]
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
            ax.set_title(f"{shape}, {context} context: {title}")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
