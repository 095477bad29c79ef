"""Paired comparison of two lm-eval runs: does a compressed cache change the answers?

`hf-loopcache compare RUN_A RUN_B` (A the baseline, e.g. the full cache; B the candidate, e.g. RIPE) reads two
lm-eval output folders written with `--output_path DIR --log_samples` (`results_<time>.json` and
`samples_<task>_<time>.jsonl`, read as plain JSON: no `lm_eval` import) and, per task, filter and metric:

- pairs the items of both runs by document id and content hash (`doc_hash`, `prompt_hash`, `target_hash`) and
  refuses runs whose items differ (other documents, prompts, few-shot examples or targets);
- `delta` = mean(B) - mean(A) over the paired items, its two-sided 95% interval from a paired bootstrap over items
  (percentile interval of the resampled mean difference; seeded, so the same inputs give the same numbers) and a
  two-sided p-value from the same bootstrap distribution shifted to the null (Koehn 2004; LoopKV Table 4 reports
  the same paired intervals and answer flips);
- `flips_down` (items scoring lower in B) and `flips_up` (higher in B); for a 0/1 metric these are McNemar's
  discordant pairs and `p_exact` is the exact two-sided McNemar (sign) test;
- a non-inferiority verdict at `margin` (default 0.03, three points of a metric in [0, 1]; in the metric's own
  units): `non-inferior` when the lower end of the interval is above `-margin` (for metrics where lower is better:
  the upper end below `+margin`), `inferior` when the whole interval lies beyond the margin, else `inconclusive`.

Suites (`suites={"ruler": ["loopcache_ruler_*"]}`, `--suite ruler=loopcache_ruler_*`) add a row for the unweighted
mean over their tasks (lm-eval's group average), resampling items within each task (a stratified bootstrap).

RULER-style metrics named after a prompt length hold `-1` for items of other lengths; a pair where both runs hold
`-1` is left out of that metric (as lm-eval's RULER aggregation does). Metrics whose per-item values are not
numbers (corpus-level metrics such as BLEU's) are listed as skipped.

Example:

```python
>>> from hf_loopcache.compare import compare_runs, load_run, to_markdown
>>> report = compare_runs(load_run("runs/full"), load_run("runs/ripe"), margin=0.03)
>>> print(to_markdown(report))
```
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Run",
    "compare_paths",
    "compare_runs",
    "exact_mcnemar_p",
    "forest_plot",
    "load_run",
    "paired_bootstrap",
    "stratified_bootstrap",
    "to_markdown",
]

PLACEHOLDER = -1.0  # RULER's value for "this item is not of this length"
_RESULTS = re.compile(r"^results_(?P<stamp>.+)\.json$")


@dataclass
class Run:
    """One lm-eval run: its results file and, per task, the sample records (one per document and filter).

    Args:
        path (`Path`): the `results_<time>.json` file.
        results (`dict`): its content.
        samples (`dict[str, list[dict]]`): task name -> records of `samples_<task>_<time>.jsonl`.
    """

    path: Path
    results: dict[str, Any]
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        config = self.results.get("config") or {}
        model_args = config.get("model_args")
        if isinstance(model_args, dict):
            model_args = ",".join(f"{k}={v}" for k, v in model_args.items())
        return str(model_args or self.path.parent)


def _find_results(path: Path) -> Path:
    if path.is_file():
        if not _RESULTS.match(path.name):
            raise ValueError(f"`run` must be an lm-eval output folder or a results_<time>.json file, got {path}")
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"`run` {path} does not exist")
    found = sorted(p for p in path.rglob("results_*.json") if _RESULTS.match(p.name))
    if not found:
        raise FileNotFoundError(
            f"no results_*.json under {path}: run lm-eval with `--output_path {path} --log_samples`"
        )
    if len(found) > 1:
        listing = ", ".join(str(p) for p in found)
        raise ValueError(
            f"{path} holds {len(found)} lm-eval runs ({listing}); pass one results_*.json file (lm-eval writes every "
            f"run of a model into the same folder: give each configuration its own --output_path)"
        )
    return found[0]


def load_run(path: str | Path) -> Run:
    """Read an lm-eval output folder (or one `results_<time>.json` in it) and its `samples_<task>_<time>.jsonl`.

    Raises:
        FileNotFoundError: no results file, or a task without its samples file (run lm-eval with `--log_samples`).
        ValueError: the folder holds several runs (pass the results file of one).
    """
    results_path = _find_results(Path(path))
    stamp = _RESULTS.match(results_path.name).group("stamp")  # type: ignore[union-attr]
    results = json.loads(results_path.read_text())
    tasks = sorted(results.get("results", {}))
    # groups (e.g. RULER's) appear in `results` without samples of their own
    groups = set(results.get("groups", {})) | set(results.get("group_subtasks", {}))
    samples: dict[str, list[dict[str, Any]]] = {}
    for task in tasks:
        file = results_path.parent / f"samples_{task}_{stamp}.jsonl"
        if not file.is_file():
            if task in groups:
                continue
            raise FileNotFoundError(
                f"{file} is missing: compare needs per-item records (run lm-eval with --log_samples)"
            )
        with file.open() as f:
            samples[task] = [json.loads(line) for line in f if line.strip()]
    if not samples:
        raise FileNotFoundError(f"{results_path} has no samples_*_{stamp}.jsonl next to it (run with --log_samples)")
    return Run(path=results_path, results=results, samples=samples)


# ---------------------------------------------------------------------------------------------- statistics
def _check_bootstrap_args(iters: int, alpha: float) -> None:
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"`iters` must be a positive int, got {iters!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"`alpha` must be in (0, 1), got {alpha}")


def _resampled_means(d: np.ndarray, iters: int, rng: np.random.Generator) -> np.ndarray:
    """`iters` means of `d` resampled with replacement (`chunk x n` indices at a time, bounded memory)."""
    n = d.size
    means = np.empty(iters)
    chunk = max(1, 2_000_000 // n)
    for start in range(0, iters, chunk):
        stop = min(iters, start + chunk)
        means[start:stop] = d[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    return means


def _summarize(delta: float, means: np.ndarray, alpha: float) -> dict[str, float]:
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    # tolerance: resampled means equal to the observed one up to float rounding count as "as extreme"
    extreme = np.abs(means - delta) >= abs(delta) - 1e-12
    p_value = (1 + int(extreme.sum())) / (1 + means.size)
    return {"delta": delta, "low": float(low), "high": float(high), "p_value": min(1.0, p_value)}


def paired_bootstrap(
    a: np.ndarray, b: np.ndarray, *, iters: int = 10_000, seed: int | list[int] = 0, alpha: float = 0.05
) -> dict[str, float]:
    """Paired bootstrap of `mean(b - a)` over items.

    Resamples the item indices with replacement `iters` times; the interval is the `alpha/2`, `1 - alpha/2`
    percentiles of the resampled mean differences, the two-sided p-value the share of resampled means at least as
    far from the observed mean as the observed mean is from 0 (the bootstrap distribution shifted to the null),
    `(1 + count) / (1 + iters)`.

    Returns:
        `{"delta", "low", "high", "p_value"}`.
    """
    return stratified_bootstrap([(a, b)], iters=iters, seed=seed, alpha=alpha)


def stratified_bootstrap(
    strata: list[tuple[np.ndarray, np.ndarray]],
    *,
    iters: int = 10_000,
    seed: int | list[int] = 0,
    alpha: float = 0.05,
) -> dict[str, float]:
    """Paired bootstrap of the unweighted mean over strata (tasks) of `mean(b - a)` per stratum, resampling items
    within each stratum: how lm-eval averages a group of tasks (`weight_by_size: false`). One stratum is
    `paired_bootstrap`.

    Returns:
        `{"delta", "low", "high", "p_value"}`.
    """
    _check_bootstrap_args(iters, alpha)
    if not strata:
        raise ValueError("`strata` must hold at least one (a, b) pair of arrays, got none")
    diffs = []
    for a, b in strata:
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1 or a.size == 0:
            raise ValueError(f"`a` and `b` must be 1-D arrays of the same positive length, got {a.shape} and {b.shape}")
        diffs.append(b - a)
    rng = np.random.default_rng(seed)
    delta = float(np.mean([d.mean() for d in diffs]))
    means = np.mean([_resampled_means(d, iters, rng) for d in diffs], axis=0)
    return _summarize(delta, means, alpha)


def exact_mcnemar_p(down: int, up: int) -> float:
    """Exact two-sided McNemar test (a sign test on the discordant pairs): under the null each of the `down + up`
    flips goes either way with probability 1/2; p = min(1, 2 * P(X <= min(down, up))), X ~ Binomial(down + up, 1/2)."""
    if down < 0 or up < 0:
        raise ValueError(f"`down` and `up` must be counts >= 0, got {down} and {up}")
    n = down + up
    if n == 0:
        return 1.0
    k = min(down, up)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def _holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment (family-wise error over all compared rows)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


# ------------------------------------------------------------------------------------------------- pairing
def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)  # bools (0/1 metrics) are ints


def _item_key(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record.get("doc_id"), record.get("filter", "none"))


def _item_hash(record: dict[str, Any]) -> tuple[Any, ...]:
    if "doc_hash" in record:
        return (record.get("doc_hash"), record.get("prompt_hash"), record.get("target_hash"))
    # records without hashes (older lm-eval): the document and the prompt themselves
    return (
        json.dumps(record.get("doc"), sort_keys=True, default=str),
        json.dumps(record.get("arguments"), default=str),
    )


def _index(task: str, records: list[dict[str, Any]], which: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for record in records:
        key = _item_key(record)
        if key in out:
            raise ValueError(f"run {which}, task {task!r}: document {key[0]} appears twice for filter {key[1]!r}")
        out[key] = record
    return out


def _pair(task: str, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    ia, ib = _index(task, a, "A"), _index(task, b, "B")
    if ia.keys() != ib.keys():
        only_a = sorted(ia.keys() - ib.keys(), key=str)[:5]
        only_b = sorted(ib.keys() - ia.keys(), key=str)[:5]
        raise ValueError(
            f"task {task!r}: the runs hold different items (doc_id, filter): only in A {only_a}, only in B {only_b}; "
            f"compare runs of the same documents (same --limit / --samples)"
        )
    pairs = []
    for key in sorted(ia, key=str):
        ra, rb = ia[key], ib[key]
        if _item_hash(ra) != _item_hash(rb):
            raise ValueError(
                f"task {task!r}, document {key[0]} (filter {key[1]!r}): the runs hold different content "
                f"(doc/prompt/target hash differ); the items must be identical to be paired"
            )
        pairs.append((ra, rb))
    return pairs


def _metric_names(records: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for record in records:
        for name in record.get("metrics", []):
            if name not in names:
                names.append(name)
    return names


def _higher_is_better(run: Run, task: str, metric: str) -> bool:
    return bool((run.results.get("higher_is_better", {}).get(task) or {}).get(metric, True))


def _verdict(low: float, high: float, margin: float, higher_is_better: bool) -> str:
    if higher_is_better:
        if low > -margin:
            return "non-inferior"
        if high < -margin:
            return "inferior"
    else:
        if high < margin:
            return "non-inferior"
        if low > margin:
            return "inferior"
    return "inconclusive"


def compare_runs(
    run_a: Run,
    run_b: Run,
    *,
    margin: float = 0.03,
    iters: int = 10_000,
    seed: int = 0,
    alpha: float = 0.05,
    tasks: list[str] | None = None,
    suites: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Paired comparison of `run_b` (candidate) against `run_a` (baseline), per task, filter and metric.

    Args:
        run_a, run_b (`Run`): from `load_run`.
        margin (`float`, *optional*, defaults to 0.03): non-inferiority margin in the metric's units.
        iters (`int`, *optional*, defaults to 10000): bootstrap resamples.
        seed (`int`, *optional*, defaults to 0): the bootstrap of each row is seeded by `seed` and the row's name, so
            a row's numbers do not depend on which other tasks are compared.
        alpha (`float`, *optional*, defaults to 0.05): two-sided level of the interval (0.05: a 95% interval).
        tasks (`list[str]`, *optional*): compare only these tasks (default: every task with samples; both runs must
            hold the same tasks).
        suites (`dict[str, list[str]]`, *optional*): name -> task name patterns (`fnmatch`, e.g.
            `{"ruler": ["loopcache_ruler_*"]}`): one more row per suite, filter and metric that all its tasks have,
            for the unweighted mean over the tasks (lm-eval's group average), bootstrapped within each task.

    Returns:
        a JSON-ready dict: `run_a`, `run_b` (results file and model arguments), the settings, `rows` (one per task,
        filter and metric, then per suite; `suite` lists a suite's tasks, None for a task: `n`, `mean_a`, `mean_b`, `delta`, `low`, `high`, `p_value`, `p_holm`, `p_exact` (0/1
        metrics), `flips_down`, `flips_up`, `answers_changed`, `higher_is_better`, `verdict`) and `skipped`.

    Raises:
        ValueError: the runs hold different tasks or items, or an argument is out of range.
    """
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"`margin` must be a number >= 0, got {margin!r}")
    if tasks is None:
        if run_a.samples.keys() != run_b.samples.keys():
            raise ValueError(
                f"the runs hold different tasks: only in A {sorted(run_a.samples.keys() - run_b.samples.keys())}, "
                f"only in B {sorted(run_b.samples.keys() - run_a.samples.keys())}; pass `tasks` to compare a subset"
            )
        tasks = sorted(run_a.samples)
    else:
        missing = [t for t in tasks if t not in run_a.samples or t not in run_b.samples]
        if missing:
            raise ValueError(
                f"`tasks` {missing} are not in both runs; tasks in A: {sorted(run_a.samples)}, in B: "
                f"{sorted(run_b.samples)}"
            )
    cells: dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray, int]] = {}
    skipped: list[dict[str, str]] = []
    for task in tasks:
        pairs = _pair(task, run_a.samples[task], run_b.samples[task])
        filters = sorted({ra.get("filter", "none") for ra, _ in pairs})
        for filt in filters:
            fpairs = [(ra, rb) for ra, rb in pairs if ra.get("filter", "none") == filt]
            for metric in _metric_names([ra for ra, _ in fpairs]):
                values = [(ra.get(metric), rb.get(metric)) for ra, rb in fpairs]
                if not all(_is_number(x) and _is_number(y) for x, y in values):
                    skipped.append(
                        {"task": task, "filter": filt, "metric": metric, "reason": "per-item values are not numbers"}
                    )
                    continue
                kept = [(ra, rb, float(x), float(y)) for (ra, rb), (x, y) in zip(fpairs, values)]  # type: ignore[arg-type]
                kept = [k for k in kept if not (k[2] == PLACEHOLDER and k[3] == PLACEHOLDER)]
                if any(k[2] == PLACEHOLDER or k[3] == PLACEHOLDER for k in kept):
                    raise ValueError(
                        f"task {task!r}, metric {metric!r}: an item holds the placeholder -1 in one run only"
                    )
                if not kept:
                    continue
                a = np.array([k[2] for k in kept])
                b = np.array([k[3] for k in kept])
                changed = sum(
                    json.dumps(ra.get("filtered_resps"), default=str)
                    != json.dumps(rb.get("filtered_resps"), default=str)
                    for ra, rb, _, _ in kept
                )
                cells[(task, filt, metric)] = (a, b, int(changed))
    # one row per task, filter and metric, then one per suite (tasks averaged, items resampled within each task)
    groups: list[tuple[str, list[str] | None, str, str, list[tuple[str, str, str]]]] = [
        (task, None, filt, metric, [(task, filt, metric)]) for task, filt, metric in cells
    ]
    for name, patterns in (suites or {}).items():
        matched = [t for t in tasks if any(fnmatch.fnmatchcase(t, pat) for pat in patterns)]
        if not matched:
            raise ValueError(f"suite {name!r}: no compared task matches {patterns}; compared tasks: {tasks}")
        for first, filt, metric in list(cells):
            if first == matched[0] and all((t, filt, metric) in cells for t in matched):
                groups.append((name, matched, filt, metric, [(t, filt, metric) for t in matched]))
    rows: list[dict[str, Any]] = []
    for label, members, filt, metric, keys in groups:
        strata = [cells[k][:2] for k in keys]
        row_seed = [seed, zlib.crc32(f"{label}|{filt}|{metric}".encode())]
        stats = stratified_bootstrap(strata, iters=iters, seed=row_seed, alpha=alpha)
        a = np.concatenate([x for x, _ in strata])
        b = np.concatenate([y for _, y in strata])
        binary = members is None and bool(np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all())
        down, up = int((b < a).sum()), int((b > a).sum())
        hib = all(_higher_is_better(run_a, t, metric) for t, _, _ in keys)
        rows.append(
            {
                "task": label,
                "suite": members,
                "filter": filt,
                "metric": metric,
                "n": int(a.size),
                "mean_a": float(np.mean([x.mean() for x, _ in strata])),
                "mean_b": float(np.mean([y.mean() for _, y in strata])),
                **stats,
                "p_exact": exact_mcnemar_p(down, up) if binary else None,
                "flips_down": down,
                "flips_up": up,
                "answers_changed": int(sum(cells[k][2] for k in keys)),
                "higher_is_better": hib,
                "verdict": _verdict(stats["low"], stats["high"], float(margin), hib),
            }
        )
    for row, p in zip(rows, _holm([r["p_value"] for r in rows])):
        row["p_holm"] = p
    return {
        "run_a": {"results": str(run_a.path), "model_args": run_a.label},
        "run_b": {"results": str(run_b.path), "model_args": run_b.label},
        "margin": float(margin),
        "iters": int(iters),
        "seed": int(seed),
        "confidence": 1 - alpha,
        "rows": rows,
        "skipped": skipped,
    }


# ------------------------------------------------------------------------------------------------- output
def _fmt(x: float) -> str:
    return f"{x:+.3f}" if x else "0.000"


def _label(row: dict[str, Any]) -> str:
    return row["task"] if not row.get("suite") else f"**{row['task']}** (mean of {len(row['suite'])} tasks)"


def to_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table (one row per task, filter and metric)."""
    conf = round(100 * report["confidence"])
    lines = [
        f"A (baseline): `{report['run_a']['model_args']}`  ",
        f"B (candidate): `{report['run_b']['model_args']}`  ",
        f"paired bootstrap over items, {report['iters']} resamples, seed {report['seed']}; "
        f"non-inferiority margin {report['margin']:g} (metric units)",
        "",
        f"| task | filter | metric | n | A | B | delta (B-A) | {conf}% interval | p | p (exact) | flips down/up "
        "| changed answers | verdict |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        exact = f"{r['p_exact']:.3g}" if r["p_exact"] is not None else "-"
        lines.append(
            f"| {_label(r)} | {r['filter']} | {r['metric']} | {r['n']} | {r['mean_a']:.3f} | {r['mean_b']:.3f} "
            f"| {_fmt(r['delta'])} | [{_fmt(r['low'])}, {_fmt(r['high'])}] | {r['p_value']:.3g} | {exact} "
            f"| {r['flips_down']}/{r['flips_up']} | {r['answers_changed']} | {r['verdict']} |"
        )
    for s in report["skipped"]:
        lines.append(f"\nskipped {s['task']} / {s['filter']} / {s['metric']}: {s['reason']}")
    return "\n".join(lines) + "\n"


def forest_plot(reports: dict[str, Any] | list[tuple[str, dict[str, Any]]], path: str | Path) -> Path:
    """A PNG forest plot of the deltas with their intervals and the non-inferiority margin: one panel per comparison
    (side by side, rows aligned when every comparison has the same rows), one line per task / metric.

    Args:
        reports: one report from `compare_runs`, or `[(label, report), ...]` to put several comparisons (e.g. RIPE
            and two LoopKV plans against the full cache) in one figure; a label titles its panel.
        path: the PNG to write (matplotlib is imported here, with its non-interactive Agg backend).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError('forest_plot needs matplotlib: pip install "hf-loopcache[eval]"') from err
    if isinstance(reports, dict):
        reports = [("", reports)]

    def row_name(r: dict[str, Any]) -> str:
        task = r["task"] if not r.get("suite") else f"{r['task']} (mean of {len(r['suite'])})"
        return f"{task} {r['metric']}" + (f" ({r['filter']})" if r["filter"] != "none" else "")

    panels = [(label, report, [row_name(r) for r in report["rows"]]) for label, report in reports]
    if not any(names for _, _, names in panels):
        raise ValueError("`reports` hold no compared rows to plot")
    aligned = all(names == panels[0][2] for _, _, names in panels)
    rows = max(len(names) for _, _, names in panels)
    lows = [min(r["low"], -report["margin"]) for _, report, _ in panels for r in report["rows"]]
    highs = [max(r["high"], report["margin"]) for _, report, _ in panels for r in report["rows"]]
    pad = 0.05 * (max(highs) - min(lows))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(3.2 * len(panels) + 3.5, 0.3 * rows + 1.4), sharey=aligned, squeeze=False
    )
    for i, (ax, (label, report, names)) in enumerate(zip(axes[0], panels)):
        ys = list(range(len(names)))[::-1]
        for y, r in zip(ys, report["rows"]):
            color = {"non-inferior": "tab:green", "inferior": "tab:red"}.get(r["verdict"], "tab:orange")
            ax.errorbar(
                r["delta"], y, xerr=[[r["delta"] - r["low"]], [r["high"] - r["delta"]]], fmt="o", color=color, capsize=3
            )
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.axvline(-report["margin"], color="gray", linestyle="--", linewidth=0.8)
        ax.set_xlim(min(lows) - pad, max(highs) + pad)
        ax.set_ylim(-0.6, rows - 0.4)
        ax.set_yticks(ys)
        if i == 0 or not aligned:
            ax.set_yticklabels(names, fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    conf = round(100 * panels[0][1]["confidence"])
    fig.supxlabel(f"delta (candidate - baseline), {conf}% paired bootstrap interval; dashed: -margin", fontsize=9)
    fig.suptitle("green: non-inferior, red: inferior, orange: inconclusive", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def short_label(baseline: str, candidate: str) -> str:
    """What sets a candidate's `model_args` apart from the baseline's (`"cache=ripe,window=64"` against
    `"pretrained=m,cache=full"`): the candidate's `key=value` items the baseline lacks, in the candidate's order."""
    base = set(baseline.split(","))
    items = [item for item in candidate.split(",") if item not in base]
    return ",".join(items) or candidate


def parse_suite(spec: str) -> tuple[str, list[str]]:
    """`"NAME=PATTERN[,PATTERN...]"` (the command line's `--suite`) -> `(name, patterns)`."""
    name, sep, patterns = spec.partition("=")
    if not sep or not name or not patterns:
        raise ValueError(f"`--suite` must be NAME=PATTERN[,PATTERN...] (e.g. ruler=loopcache_ruler_*), got {spec!r}")
    return name, patterns.split(",")


def compare_paths(
    run_a: str | Path,
    runs_b: list[str | Path],
    *,
    margin: float = 0.03,
    iters: int = 10_000,
    seed: int = 0,
    tasks: list[str] | None = None,
    suites: list[str] | None = None,
    json_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    plot_path: str | Path | None = None,
) -> str:
    """`hf-loopcache compare RUN_A RUN_B [RUN_C ...]`: each candidate run against the baseline `run_a`; writes the
    JSON (`{"comparisons": [report, ...]}`), Markdown and forest plot (all candidates in one figure) that are asked
    for and returns the Markdown. `suites` are `--suite` strings (`parse_suite`)."""
    parsed = dict(parse_suite(spec) for spec in suites or [])
    baseline = load_run(run_a)
    reports = [
        compare_runs(baseline, load_run(b), margin=margin, iters=iters, seed=seed, tasks=tasks, suites=parsed)
        for b in runs_b
    ]
    text = "\n".join(to_markdown(report) for report in reports)
    if markdown_path:
        Path(markdown_path).write_text(text)
    if json_path:
        Path(json_path).write_text(json.dumps({"comparisons": reports}, indent=2) + "\n")
    if plot_path:
        forest_plot(
            [(short_label(baseline.label, report["run_b"]["model_args"]), report) for report in reports], plot_path
        )
    return text
