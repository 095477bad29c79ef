"""The plain `lm_eval --model hf-loopcache` door: the `.pth` start-up hook in a fresh virtual environment (start-up
imports only the tiny hook module; `--model hf` still resolves; nothing of ours loads until lm-eval asks for the
model), and data-parallel evaluation with two CPU processes under `accelerate launch`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
PTH = "hf_loopcache_lm_eval.pth"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
ENV.pop("PYTHONPATH", None)


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> tuple[Path, Path]:
    """A new virtual environment whose site-packages holds the hook's .pth, with this checkout and the packages of
    the running interpreter on its path (as an installed hf-loopcache[eval] would have them)."""
    home = tmp_path_factory.mktemp("hook-env")
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(
        subprocess.check_output([python, "-c", "import site; print(site.getsitepackages()[0])"], text=True).strip()
    )
    deps = Path(lm_eval.__file__).resolve().parents[1]
    fixtures = ROOT / "hf-loopcache-fixtures"  # the fixtures distribution's package folder (installed beside it)
    (site / "_paths.pth").write_text(f"{ROOT}\n{fixtures}\n{deps}\n")  # sorts before the hook, as in a real install
    shutil.copy(ROOT / PTH, site / PTH)
    return python, site


def run(python, code, **env):
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env={**ENV, **env}, timeout=300)


def startup_modules(python) -> dict[str, int]:
    """Modules imported by `python -c pass` and their cumulative import time in microseconds (the least of 3 warm
    starts: the first start may compile bytecode)."""
    best: dict[str, int] = {}
    for _ in range(4):
        out = subprocess.run([python, "-X", "importtime", "-c", "pass"], capture_output=True, text=True, env=ENV)
        rows = re.findall(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)", out.stderr)
        times = {name: int(cumulative) for _, cumulative, name in rows}
        best = times if not best else {k: min(v, best.get(k, v)) for k, v in times.items()}
    return best


def test_startup_imports_only_the_tiny_hook(env_python):
    python, site = env_python
    with_hook = startup_modules(python)
    (site / PTH).rename(site / "hook.off")
    try:
        without = startup_modules(python)
    finally:
        (site / "hook.off").rename(site / PTH)
    assert set(with_hook) - set(without) == {"_hf_loopcache_lm_eval"}
    # microseconds: ~400 us measured on the 2-core CI machine, 7.6 ms once under load; importing torch or lm_eval from
    # the hook would take hundreds of milliseconds, so the bound catches that without timing the machine
    assert with_hook["_hf_loopcache_lm_eval"] < 100_000


def test_plain_lm_eval_registry_resolves_both_models(env_python):
    python, _ = env_python
    code = (
        "import sys; import lm_eval.models; from lm_eval.api.registry import get_model, model_registry; "
        "assert 'hf-loopcache' in model_registry; "
        "assert not {'eval_tasks', 'hf_loopcache', 'torch'} & set(sys.modules), 'imported too early'; "
        "print(get_model('hf').__name__, get_model('hf-loopcache').__module__)"
    )
    out = run(python, code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["HFLM", "eval_tasks.model"]
    # get_model on an empty registry imports the built-ins itself; the hook must not make it look non-empty
    out = run(python, "from lm_eval.api.registry import get_model; print(get_model('hf').__name__)")
    assert out.returncode == 0 and out.stdout.strip() == "HFLM", out.stderr[-2000:]


def test_hook_can_be_switched_off(env_python):
    python, _ = env_python
    out = run(
        python, "from lm_eval.api.registry import get_model; get_model('hf-loopcache')", HF_LOOPCACHE_LM_EVAL_HOOK="0"
    )
    assert out.returncode != 0 and "no model for this name found" in out.stderr


DOCS = [
    {"q": "And the LORD spake unto Moses, saying,", "a": " Speak", "choices": [" Speak", " Moses", " the"], "gold": 0},
    {
        "q": "In the beginning God created the heaven and",
        "a": " the earth",
        "choices": [" the earth", " water"],
        "gold": 0,
    },
    {"q": "def add(a, b):\n    return", "a": " a + b", "choices": [" a + b", " None", " a"], "gold": 0},
    {"q": "Question: Tom has 3 apples and buys 5 more.\nAnswer:", "a": " 8", "choices": [" 8", " 5"], "gold": 0},
    {"q": "SELECT * FROM", "a": " users", "choices": [" users", " table"], "gold": 1},
]


def write_tasks(folder: Path) -> list[str]:
    """A generate_until task and a multiple-choice (loglikelihood) task over five local documents."""
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "gen.yaml").write_text(
        f"task: lc_dp_gen\n{common}output_type: generate_until\ndoc_to_text: '{{{{q}}}}'\ndoc_to_target: '{{{{a}}}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "mc.yaml").write_text(
        f"task: lc_dp_mc\n{common}output_type: multiple_choice\ndoc_to_text: '{{{{q}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return [str(folder / "gen.yaml"), str(folder / "mc.yaml")]


@pytest.mark.slow
def test_data_parallel_on_two_cpu_processes(env_python, tmp_path):
    """`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m lm_eval --model hf-loopcache ...`:
    each rank answers its own half of the requests (its response-cache database holds them: disjoint, together all
    17), and only rank 0 writes results, with every document in its samples."""
    python, _ = env_python
    tasks = write_tasks(tmp_path)
    cmd = [
        python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "lm_eval", "--model", "hf-loopcache",
        "--model_args", "pretrained=tiny-ouro,cache=ripe,window=4,dtype=float32", "--tasks", *tasks,
        "--batch_size", "2", "--output_path", str(tmp_path / "out"), "--log_samples", "--use_cache", str(tmp_path / "rc"),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, "ACCELERATE_USE_CPU": "1"}, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    from sqlitedict import SqliteDict

    from eval_tasks.guards import RESPONSE_CACHE_STAMP

    answered = []
    for rank in (0, 1):
        with SqliteDict(str(tmp_path / f"rc_rank{rank}.db")) as db:
            assert db[RESPONSE_CACHE_STAMP]["cache"] == "ripe"
            answered.append({k for k in db if k != RESPONSE_CACHE_STAMP})
    assert answered[0] and answered[1] and not answered[0] & answered[1]
    assert len(answered[0] | answered[1]) == len(DOCS) + sum(len(d["choices"]) for d in DOCS)
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert len(results) == 1
    for task in ("lc_dp_gen", "lc_dp_mc"):
        (samples,) = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
        assert sorted(json.loads(line)["doc_id"] for line in samples.read_text().splitlines()) == list(range(5))
