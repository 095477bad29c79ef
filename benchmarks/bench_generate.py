"""End-to-end `model.generate` with a looped-model cache, beside transformers' own caches on a plain model.

Method (gpt-fast style): per configuration a warm-up generate of 4 tokens at the measured shape (Triton's kernels
compile per argument specialisation at their first launch; `warmup_s`), then a prefill-only run (`max_new_tokens=1`) and a
full run; decode time = full - prefill (the same for CPU time, from `time.process_time`); CUDA synchronised around
every timer; peak memory from `torch.cuda.max_memory_allocated` (reset before each run). Out-of-memory is recorded
as a row, not an error. With `--count-kernels`, one more pair of runs under `torch.profiler` counts CUDA kernel
launches per decode step.

Peers (`--peers`): a plain `Qwen2ForCausalLM` of the looped model's width whose layer count equals the looped
model's slot count (Ouro-1.4B: 24 layers x 4 loops = 96 layers), so it stores the same KV bytes per token as
`FullLoopCache` and runs the same attention and MLP work per token; measured in the same run with transformers'
`DynamicCache` (`dynamic`), `StaticCache` with transformers' automatically compiled decode step (`static`), and
`QuantizedCache` (`quantized`, needs a quantization backend; recorded as unavailable without one). The result file is rewritten after
every row, so a run stopped by a time limit keeps the rows that finished.

Modes of the looped caches (`--modes`): `eager` (the growable cache, the default), `static` (the same plan built with
`static=True, max_batch_size=batch, max_cache_len=context`, decoded eagerly: `generate(disable_compile=True)`), and
`graph` (static, decoded through `generate`'s compiled call, which replays a CUDA graph of the one-token step per
batch size). A static cache is built once per configuration and `reset()` between runs, so the graph captured in the
warm-up run is replayed by the measured ones; `capture_s` is the warm-up step plus the capture. Static rows record
whether their greedy tokens equal the eager run's (`tokens_equal_eager`, when `eager` ran first) and, for `graph`,
the static eager run's (`tokens_equal_static`), with the first generated step that differs.

`--fused on off` measures the looped models both with their fused layer kernels (`triton_ops.fused`: RMS norm with
the residual, RoPE, `silu(gate) * up`, one kernel each; the default on CUDA) and op by op (`fused.disabled()`); the
row says which (`fused_ops`), and token comparisons stay within one setting.

`--pdl on off` measures the step's Triton kernels launched with programmatic dependent launch (`triton_ops._dispatch.PDL`,
off by default; on only where the GPU and Triton have it) and without; the row says whether its launches took it (`pdl`), and a
`pdl` row records whether its greedy tokens equal the same row's without it (`tokens_equal_pdl_off`, when that ran
first). `--fuse-silu on off` does the same for Ouro's down projection reading `silu(gate) * up` in its GEMV kernel
(`triton_ops.gemv.GEMV_TUNING["fuse_silu"]`; row `fuse_silu`, `tokens_equal_fuse_off`). `--gemv on off` the same for
the decode projections on the Triton GEMV (`GEMV_TUNING["enabled"]`: the shapes `GEMV_CONFIGS` lists) or all on cuBLAS
(row `gemv`), and `--fuse-rope on off` for Ouro's q/k/v projection rotating queries and keys in its GEMV kernel
(`GEMV_TUNING["fuse_rope"]`; row `fuse_rope`, `tokens_equal_fuse_rope_off`). `--defer-stop on off` measures
`generate` reading its stop flag one step late (`generate(defer_stop=...)`, on by default: the host queues the next
step while the GPU runs this one) and waiting for the GPU at every step (row `defer_stop`,
`tokens_equal_defer_stop_off`; pass `off on`). `--fuse-kv on off` the same for Ouro's q/k/v kernel storing a
static dense cell's keys and values itself (`GEMV_TUNING["fuse_kv"]`; row `fuse_kv`, `tokens_equal_fuse_kv_off`; pass
`off on`). `--shared-read kernel sdpa` the same for how a static RIPE / deepest-plane shared cell reads its BF16
source in a one-token step (`StaticCodedSharedLayer.history_read`: cuDNN over the source merged with the kernel's read
of the rest, or all in the kernel; row `shared_read`, `tokens_equal_shared_sdpa_off`). `--one-launch on off` the same
for `coded_attention`'s one-launch read of a view with no history to split (`TAIL_TUNING["final_slots"]`: RIPE's and
the deepest plane's shared cells in a one-token step, whose history cuDNN reads; row `one_launch`,
`tokens_equal_one_launch_off`; pass `off on`), and `--whole-source on off` for the deepest plane's one-token step
read by its source's own read (`StaticCodedSharedLayer.whole_source`; row `whole_source`,
`tokens_equal_whole_source_off`; pass `off on`). `--vprec-lookback off on` the same for V precision over a split
history in one launch (`ROW1_TUNING["vprec_lookback"]`: the `kivi4-vp` cache; row `vprec_lookback`,
`tokens_equal_vprec_lookback_off`), and `--vprec-optimistic off on` for its optimistic pass
(`ROW1_TUNING["vprec_optimistic"]`; row `vprec_optimistic`, `tokens_equal_vprec_optimistic_off`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import itertools
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList

from benchmarks.common import StepClock, build, peak_gib, reset_peak, write_rows
from hf_loopcache import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache
from hf_loopcache._compat import CACHE_KWARG, OUTPUT_CACHE_FIELD
from hf_loopcache.cache.layers.static import StaticDenseLayer, dense_read
from hf_loopcache.cache.layers.static_coded import StaticCodedSharedLayer
from triton_ops import fused
from triton_ops._dispatch import PDL, pdl_options
from triton_ops.coded_attention.ops import ROW1_TUNING, TAIL_TUNING
from triton_ops.gemv import GEMV_TUNING

CACHES = {  # keyword options: `static`, `max_batch_size`, `max_cache_len` (the `static` and `graph` modes)
    "full": lambda model, **kw: FullLoopCache(model, **kw),
    "ripe64": lambda model, **kw: RIPECache(model, window=64, **kw),
    "deepest": lambda model, **kw: DeepestPlaneCache(model, **kw),
    "kivi4": lambda model, **kw: LoopKVCache(model, "kivi4", tau=None, **kw),
    "kivi4-vp": lambda model, **kw: LoopKVCache(model, "kivi4", **kw),
    "kivi2": lambda model, **kw: LoopKVCache(model, "kivi2", tau=None, **kw),
    "kivi4-share": lambda model, **kw: LoopKVCache(model, "kivi4-share", tau=None, **kw),
    "hand": lambda model, **kw: LoopKVCache(model, "hand", tau=None, **kw),
}

PEERS = ("dynamic", "static", "quantized")
#: QuantizedCache backends tried in order (the first that builds is used; the row names it)
QUANTIZED_BACKENDS = ("quanto", "hqq", "fp8")
#: the static peer's `CompileConfig`: one graph, static shapes (no recompile with dynamic shapes at the second batch
#: size), transformers' default mode (inductor with CUDA graphs)
PEER_COMPILE = ("fullgraph=true", "dynamic=false", "mode=reduce-overhead")
MODES = ("eager", "static", "graph")


def peer_model(looped: Any, dtype: torch.dtype, device: str):
    """A plain Qwen2 of the looped model's width with one layer per looped slot (same KV bytes per token)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = looped.config
    layout = looped.loop_layout
    config = Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=layout.num_cells,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=layout.head_dim,
        # Huginn's config names these `block_size` / `norm_eps` (the peer only needs positions >= the context)
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None) or cfg.block_size,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", None) or cfg.norm_eps,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


def _peer_kwargs(model: Any, name: str, *, context: int, quantized_backends: tuple[str, ...]) -> dict[str, Any]:
    """The cache keywords of a peer row (one call per configuration: a static cache is reused by its runs)."""
    if name == "dynamic":
        return {}
    if name == "static":  # transformers' own StaticCache: `generate` compiles the decode step since `is_compileable`
        from transformers import StaticCache

        return {CACHE_KWARG: StaticCache(config=model.config, max_cache_len=context)}
    if name == "quantized":
        from transformers import QuantizedCache

        errors = []
        for backend in quantized_backends:
            try:
                bits = {} if backend == "fp8" else {"nbits": 4}  # fp8 (newer transformers) is per tensor, no bits
                return {CACHE_KWARG: QuantizedCache(backend=backend, config=model.config, **bits), "_backend": backend}
            except (ImportError, ValueError, RuntimeError) as err:
                errors.append(f"{backend}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
        raise ImportError("no QuantizedCache backend: " + "; ".join(errors))
    raise ValueError(f"`--peers` must name some of {PEERS}, got {name!r}")


def parse_compile_config(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` items of transformers' `CompileConfig` (`fullgraph`, `dynamic`, `backend`, `mode`): true / false /
    none as Python values, the rest as strings."""
    words = {"true": True, "false": False, "none": None}
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ("fullgraph", "dynamic", "backend", "mode"):
            raise SystemExit(f"--peer-compile takes KEY=VALUE with KEY one of fullgraph, dynamic, backend, mode; got {item!r}")
        options[key] = words.get(value.lower(), value)
    return options


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> tuple[Any, float, float]:
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _free_gib(device: str) -> float | None:
    return round(torch.cuda.mem_get_info()[0] / 2**30, 2) if device.startswith("cuda") else None


def warmup_length(short: int, prompt_len: int, capacity: int, cuda: bool) -> int:
    """The prompt of a static cache's short warm-up: the shortest of at least `short` tokens whose decode steps read the
    storage as the timed run's first step does (`layers.static.dense_read`, monotone in the positions held: under
    `read_method = "auto"` the kernel while the storage is at most 2/3 full, cuDNN beyond; a captured step is keyed
    by which), so the timed run replays what the warm-up captured instead of capturing inside it."""

    def read(length: int) -> str:
        return dense_read(StaticDenseLayer.read_method, length, 1, capacity, cuda)

    timed = read(prompt_len)
    low, high = short, prompt_len
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if read(mid) == timed else (mid + 1, high)
    return low


def run_one(
    model,
    shape: str,
    cache_name: str,
    batch: int,
    context: int,
    new_tokens: int,
    device: str,
    *,
    peer: bool = False,
    count_kernels: bool = False,
    mode: str = "eager",
    reference: dict[tuple, torch.Tensor] | None = None,
    fused_ops: bool = True,
    timing: str = "pair",
    warmup_prompt: int | None = None,
    compile_config: dict[str, Any] | None = None,
    quantized_backends: tuple[str, ...] = QUANTIZED_BACKENDS,
    defer_stop: bool = True,
) -> dict[str, Any]:
    """One row. `timing="pair"`: decode = a full run minus a prefill-only run; `"steps"`: one run, decode timed from
    the first generated token to the last by a logits processor that records a CUDA event per token (`StepClock`: no
    sync added, so the step is the one a user's `generate` runs); `"steps-sync"`: the same with a host sync at each
    token (the suite's clock up to session 20: it counts transformers' work between the processors and the stop check
    in the step). `warmup_prompt`: the
    warm-up run of a static cache (ours in `static` / `graph` mode, the `static` peer) and of the quantized peer uses
    the prompt's first `warmup_prompt` tokens (the captured or compiled step depends on the cache's shape, not the
    prompt's length; on CUDA, ours take as many more as the timed steps' dense read needs: `warmup_length`)."""
    vocab = model.config.vocab_size
    prompt_len = context - new_tokens
    pdl = bool(pdl_options(torch.empty(0, device=device))["USE_PDL"]) if not peer else None
    torch.manual_seed(batch)
    ids = torch.randint(1, vocab, (batch, prompt_len), device=device)
    row: dict[str, Any] = {
        "shape": shape,
        "cache": cache_name,
        "mode": "peer" if peer else mode,
        "static_read": StaticDenseLayer.read_method if mode != "eager" and not peer else None,
        "shared_read": StaticCodedSharedLayer.history_read if mode != "eager" and not peer else None,
        "fused_ops": fused_ops if not peer else None,
        "pdl": pdl,
        "fuse_silu": bool(GEMV_TUNING["fuse_silu"]) if not peer else None,
        "fuse_rope": bool(GEMV_TUNING["fuse_rope"]) if not peer else None,
        "gemv": bool(GEMV_TUNING["enabled"]) if not peer else None,
        "defer_stop": defer_stop if not peer else None,
        "fuse_kv": bool(GEMV_TUNING["fuse_kv"]) if not peer else None,
        "one_launch": bool(TAIL_TUNING["final_slots"]) if not peer else None,
        "whole_source": StaticCodedSharedLayer.whole_source if mode != "eager" and not peer else None,
        "vprec_lookback": bool(ROW1_TUNING["vprec_lookback"]) if not peer else None,
        "vprec_optimistic": bool(ROW1_TUNING["vprec_optimistic"]) if not peer else None,
        "model": "plain Qwen2 peer" if peer else "looped",
        "batch": batch,
        "context": context,
        "prompt": prompt_len,
        "new_tokens": new_tokens,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "timing": timing,
        "free_gib_at_start": _free_gib(device),
    }
    if not peer:
        row["layout"] = model.loop_layout.describe()
        row["kv_bytes_per_token_formula"] = model.loop_layout.full_bytes_per_token()
    extra = {"init_scale": 0.0} if shape.startswith("huginn") and not peer else {}
    gen = dict(do_sample=False, pad_token_id=0, **extra)
    static_cache = None
    peer_kwargs: dict[str, Any] = {}
    # a short warm-up suffices where the step's shape is the cache's (static caches) or nothing compiles per prompt
    # length (the quantized peer: its first run only imports and builds the backend)
    static = (not peer and mode != "eager") or (peer and cache_name in ("static", "quantized"))
    short = warmup_prompt if static and warmup_prompt is not None and warmup_prompt < prompt_len else None
    if short is not None and not peer:
        short = warmup_length(short, prompt_len, context, device.startswith("cuda"))

    def generate(tokens: int, prompt: torch.Tensor = ids, clock: StepClock | None = None) -> tuple[torch.Tensor, Any]:
        kw = dict(gen, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, min_new_tokens=tokens)
        if clock is not None:
            kw["logits_processor"] = LogitsProcessorList([clock])
        if peer:
            cache = peer_kwargs.get(CACHE_KWARG)
            if cache is not None and hasattr(cache, "reset") and cache_name == "static":
                cache.reset()
            if cache_name == "quantized":  # a fresh quantized cache per run (it grows)
                kw.update({k: v for k, v in _peer_kwargs(model, cache_name, context=context,
                                                         quantized_backends=quantized_backends).items()
                           if not k.startswith("_")})
            elif cache is not None:
                kw[CACHE_KWARG] = cache
            if compile_config is not None and cache_name == "static":
                from transformers import CompileConfig

                kw["compile_config"] = CompileConfig(**compile_config)
            out = model.generate(prompt, return_dict_in_generate=True, **kw)
            return out.sequences, getattr(out, OUTPUT_CACHE_FIELD, None)
        cache = CACHES[cache_name](model) if static_cache is None else static_cache
        cache.reset()
        out = model.generate(prompt, cache=cache, defer_stop=defer_stop, **kw)
        return out, cache

    try:
        if not peer and mode != "eager" and cache_name == "full" and device.startswith("cuda"):
            needed = model.loop_layout.full_bytes(context) * batch
            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
            if needed > total:  # not attempted: filling the GPU to fail would disturb a process beside this one
                raise torch.OutOfMemoryError(
                    f"not attempted: the static full cache needs {needed / 2**30:.1f} GiB, more than the GPU's "
                    f"{total / 2**30:.1f} GiB"
                )
        if not peer and mode != "eager":  # inside the try: a static cache that does not fit is an `oom` row
            static_cache = CACHES[cache_name](model, static=True, max_batch_size=batch, max_cache_len=context)
            gen["disable_compile"] = mode == "static"
        if peer:
            peer_kwargs.update(_peer_kwargs(model, cache_name, context=context, quantized_backends=quantized_backends))
            if "_backend" in peer_kwargs:
                row["quantized_backend"] = peer_kwargs.pop("_backend")
            if cache_name == "static":
                row["compile_config"] = compile_config if compile_config is not None else "transformers' default"
        warm_prompt = ids if short is None else ids[:, :short]
        row["warmup_prompt"] = int(warm_prompt.shape[1])
        # warm-up at this shape: Triton compiles a kernel per argument specialisation at its first launch (eager
        # rows included), a graph is captured in `graph` mode, transformers compiles the static peer's decode step
        _, t_warm, _ = _timed(lambda: generate(min(4, new_tokens), warm_prompt), device)
        row["compile_warmup_s" if peer and cache_name == "static" else "warmup_s"] = round(t_warm, 2)
        if mode == "graph" and static_cache is not None:
            row["capture_s"] = [step["capture_s"] for step in static_cache.captured_steps()]
        if timing == "pair":
            reset_peak(device)
            prefill_only, t_prefill, c_prefill = _timed(lambda: generate(1), device)
            del prefill_only  # free its cache before the full run
            reset_peak(device)
            (out, cache), t_total, c_total = _timed(lambda: generate(new_tokens), device)
            steps = new_tokens - 1
            decode, cpu = t_total - t_prefill, c_total - c_prefill
        else:
            reset_peak(device)
            clock = StepClock(device, sync=timing == "steps-sync")
            (out, cache), t_total, _ = _timed(lambda: generate(new_tokens, clock=clock), device)
            steps, decode, cpu = clock.decode()
            t_prefill = t_total - decode
            row["ms_per_decode_step_median"] = round(1000 * clock.median_step_s(), 3)
        row.update(
            status="ok",
            prefill_s=round(t_prefill, 4),
            total_s=round(t_total, 4),
            decode_s=round(decode, 4),
            decode_tokens_per_s=round(batch * steps / decode, 2),
            ms_per_decode_step=round(1000 * decode / steps, 3),
            cpu_ms_per_decode_step=round(1000 * cpu / steps, 3),
            peak_memory_gib=peak_gib(device),
            generated=int(out.shape[1] - prompt_len),
        )
        if reference is not None and not peer:
            key = (shape, cache_name, batch, context, new_tokens, fused_ops, bool(GEMV_TUNING["fuse_rope"]),
                   bool(GEMV_TUNING["fuse_silu"]), pdl)
            switches = (("defer_stop", defer_stop), ("fuse_kv", bool(GEMV_TUNING["fuse_kv"])),
                        ("shared_sdpa", StaticCodedSharedLayer.history_read == "sdpa"),
                        ("one_launch", bool(TAIL_TUNING["final_slots"])),
                        ("whole_source", StaticCodedSharedLayer.whole_source),
                        ("vprec_lookback", bool(ROW1_TUNING["vprec_lookback"])),
                        ("vprec_optimistic", bool(ROW1_TUNING["vprec_optimistic"])))  # fmt: skip
            for name, on in switches:
                if not on:
                    reference[(*key, mode, f"{name}_off")] = out.cpu()
                elif (*key, mode, f"{name}_off") in reference:
                    seen = reference[(*key, mode, f"{name}_off")]
                    row[f"tokens_equal_{name}_off"] = bool(torch.equal(seen, out.cpu()))
                    row[f"first_mismatch_{name}_off"] = _first_mismatch(seen, out.cpu(), prompt_len)
            reference[(*key, mode)] = out.cpu()
            for other in ("eager", "static"):
                if other != mode and (*key, other) in reference and not (mode == "static" and other != "eager"):
                    seen = reference[(*key, other)]
                    row[f"tokens_equal_{other}"] = bool(torch.equal(seen, out.cpu()))
                    row[f"first_mismatch_{other}"] = _first_mismatch(seen, out.cpu(), prompt_len)
            if pdl and (*key[:-1], False, mode) in reference:
                seen = reference[(*key[:-1], False, mode)]
                row["tokens_equal_pdl_off"] = bool(torch.equal(seen, out.cpu()))
                row["first_mismatch_pdl_off"] = _first_mismatch(seen, out.cpu(), prompt_len)
            if key[-2] and (*key[:-2], False, pdl, mode) in reference:
                seen = reference[(*key[:-2], False, pdl, mode)]
                row["tokens_equal_fuse_off"] = bool(torch.equal(seen, out.cpu()))
                row["first_mismatch_fuse_off"] = _first_mismatch(seen, out.cpu(), prompt_len)
            if key[6] and (*key[:6], False, *key[7:], mode) in reference:
                seen = reference[(*key[:6], False, *key[7:], mode)]
                row["tokens_equal_fuse_rope_off"] = bool(torch.equal(seen, out.cpu()))
                row["first_mismatch_fuse_rope_off"] = _first_mismatch(seen, out.cpu(), prompt_len)
        if not peer:
            row.update(
                cache_allocated_gib=round(cache.nbytes() / 2**30, 3),
                cache_stored_gib=round(cache.stored_bytes() / 2**30, 3),
                cache_stored_bytes_per_token=round(cache.stored_bytes() / (batch * (out.shape[1] - 1)), 1),
            )
        del cache, out
        if count_kernels and device.startswith("cuda"):
            k_total = _count_kernels(lambda: generate(new_tokens))
            k_prefill = _count_kernels(lambda: generate(1))
            row["kernels_per_decode_step"] = round((k_total - k_prefill) / (new_tokens - 1), 1)
    except torch.OutOfMemoryError as err:
        needed = model.loop_layout.full_bytes(context) * batch if cache_name == "full" and not peer else None
        row.update(status="oom", error=str(err).splitlines()[0][:200], kv_bytes_needed_formula=needed,
                   peak_memory_gib=peak_gib(device))
    except (ImportError, ValueError, RuntimeError) as err:
        if not peer:
            raise
        row.update(status="unavailable", error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    static_cache = None
    peer_kwargs.clear()
    gc.collect()
    reset_peak(device)
    return row


def _first_mismatch(a: torch.Tensor, b: torch.Tensor, start: int) -> int | None:
    """The first generated step at which two greedy outputs differ (None when equal)."""
    differ = (a[:, start:] != b[:, start:]).any(dim=0).nonzero()
    return None if differ.numel() == 0 else int(differ[0])


def precompile_static_peer(peer: Any, shape: str, batches: list[int], contexts: list[int], device: str, *,
                           compile_config: dict[str, Any] | None, warmup_prompt: int, progress=lambda row: None) -> dict:
    """Compile transformers' static decode step of the plain peer for every (batch, context) before any timed run: a
    generate of 4 tokens from a `warmup_prompt`-token prompt into a `StaticCache` of the measured length (the compiled
    step depends on the cache's shape only; a short prompt keeps the GPU nearly idle while other rows run). The cache
    is freed after each (a later one of the same shape reuses the compiled code; CUDA graphs are re-recorded by the
    row's own warm-up). A `fullgraph=True` compile that fails (a graph break) is retried once with `fullgraph=False`.
    Returns {(batch, context): {"compile_warmup_s": s, "compile_config": the options used} or {"error": ...}}, and
    under "fallback" the failed attempts."""
    from transformers import CompileConfig, StaticCache

    done: dict[tuple[int, int], dict] = {}
    for context, batch in itertools.product(contexts, batches):
        progress({"shape": shape, "cache": "static", "mode": "peer", "model": "plain Qwen2 peer", "batch": batch,
                  "context": context, "status": "compiling", "compile_started": _dt.datetime.now(_dt.timezone.utc)
                  .isoformat(timespec="seconds"), "compile_config": compile_config, "compiled_before": {
                      f"{k[0]}x{k[1]}" if isinstance(k, tuple) else k: v for k, v in done.items()}})
        ids = torch.randint(1, peer.config.vocab_size, (batch, warmup_prompt), device=device)
        kw: dict[str, Any] = {CACHE_KWARG: StaticCache(config=peer.config, max_cache_len=context)}
        options = compile_config
        while True:
            if options is not None:
                kw["compile_config"] = CompileConfig(**options)
            try:
                _sync(device)
                start = time.perf_counter()
                peer.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                              do_sample=False, pad_token_id=0, **kw)
                _sync(device)
                seconds = time.perf_counter() - start
                done[(batch, context)] = {"compile_warmup_s": round(seconds, 2), "compile_config": options}
                break
            except (torch.OutOfMemoryError, RuntimeError, ValueError) as err:
                failed = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                if options is not None and options.get("fullgraph") and not isinstance(err, torch.OutOfMemoryError):
                    # one graph was asked for and the model breaks it: transformers' default (graph breaks allowed)
                    done.setdefault("fallback", []).append({"batch": batch, "context": context, "error": failed})
                    options = {**options, "fullgraph": False}
                    torch._dynamo.reset()
                    continue
                done[(batch, context)] = {"error": failed, "compile_config": options}
                break
        kw.clear()
        gc.collect()
        reset_peak(device)
    return done


def wait_for(path: str, timeout_s: float | None) -> float:
    """Block until `path` exists (or `timeout_s` passes); returns the seconds waited."""
    start = time.perf_counter()
    while not Path(path).exists():
        if timeout_s is not None and time.perf_counter() - start > timeout_s:
            break
        time.sleep(0.2)
    return round(time.perf_counter() - start, 1)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main` (the suite's tests parse its command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["ouro-1.4b", "huginn-0125"], help="model shapes")
    parser.add_argument("--caches", nargs="+", default=["full"], choices=sorted(CACHES), help="looped-model caches")
    parser.add_argument("--peers", nargs="*", default=[], choices=PEERS, help="transformers caches on the plain peer")
    parser.add_argument("--peers-only", action="store_true",
                        help="only the peers (the looped model is built on the meta device, for its shape)")
    parser.add_argument("--peers-after", default=None, metavar="FILE",
                        help="compile the static peer first, then wait until FILE exists before the timed peer rows")
    parser.add_argument("--peers-wait-s", type=float, default=None, help="wait at most this long for --peers-after")
    parser.add_argument("--peer-compile", nargs="*", default=list(PEER_COMPILE), metavar="KEY=VALUE",
                        help="transformers CompileConfig of the static peer (none given: transformers' default)")
    parser.add_argument("--quantized-backends", nargs="+", default=list(QUANTIZED_BACKENDS),
                        help="QuantizedCache backends to try in order (quanto, hqq, and on newer transformers fp8)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="batch sizes")
    parser.add_argument("--context", type=int, nargs="+", default=[8192], help="prompt + new tokens (one or more)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
    parser.add_argument("--timing", default="pair", choices=("pair", "steps", "steps-sync"),
                        help="decode time: full run minus a prefill-only run (pair), or per step in one run (steps: CUDA "
                             "events, no sync added; steps-sync: a sync at each token, the suite's clock to session 20)")
    parser.add_argument("--warmup-prompt", type=int, default=None,
                        help="prompt tokens of a static cache's warm-up run (default: the whole prompt)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no row expected to end past this many seconds (its prefill estimated from the slowest "
                             "prefill per row and token so far, plus the median rest of a row; skipped rows: deadline)")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype")
    parser.add_argument("--out", default="generate", help="result file name under benchmarks/results/")
    parser.add_argument("--device", default="cuda", help="torch device")
    parser.add_argument("--count-kernels", action="store_true", help="also count CUDA kernels per decode step")
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=MODES,
                        help="looped-cache modes: growable eager, static eager, static with the captured decode step")
    parser.add_argument("--static", action="store_true", help="add the `static` mode")
    parser.add_argument("--graph", action="store_true", help="add the `graph` mode (static + captured decode step)")
    parser.add_argument("--fused", nargs="+", default=["on"], choices=("on", "off"),
                        help="looped models' norms, RoPE and activation as fused kernels (on) or op by op (off)")
    parser.add_argument("--pdl", nargs="+", default=["off"], choices=("on", "off"),
                        help="the step's Triton kernels with programmatic dependent launch where supported (on) or not")
    parser.add_argument("--gemv", nargs="+", default=["on"], choices=("on", "off"),
                        help="decode projections on the Triton GEMV where GEMV_CONFIGS lists them (on) or on cuBLAS (off)")
    parser.add_argument("--fuse-silu", nargs="+", default=["on"], choices=("on", "off"),
                        help="Ouro's down projection reads silu(gate) * up in its GEMV kernel where it takes it (on)")
    parser.add_argument("--fuse-rope", nargs="+", default=["on"], choices=("on", "off"),
                        help="Ouro's q/k/v projection rotates queries and keys in its GEMV kernel where it takes it (on)")
    parser.add_argument("--fuse-kv", nargs="+", default=["on"], choices=("on", "off"),
                        help="Ouro's q/k/v kernel stores a static dense cell's keys and values itself (on) or not")
    parser.add_argument("--defer-stop", nargs="+", default=["on"], choices=("on", "off"),
                        help="generate reads its stop flag one step late (on) or waits for the GPU every step (off)")
    parser.add_argument("--shared-read", nargs="+", default=[StaticCodedSharedLayer.history_read],
                        choices=("sdpa", "kernel"),
                        help="how a static shared cell reads a BF16 source (StaticCodedSharedLayer.history_read)")
    parser.add_argument("--one-launch", nargs="+", default=["on"], choices=("on", "off"),
                        help="coded_attention reads a view with no history to split in one launch (on) or not "
                             "(TAIL_TUNING['final_slots'])")
    parser.add_argument("--whole-source", nargs="+", default=["on"], choices=("on", "off"),
                        help="the deepest plane's one-token step is read by its source's own read (on) or as RIPE's "
                             "(StaticCodedSharedLayer.whole_source)")
    parser.add_argument("--vprec-lookback", nargs="+", default=["off"], choices=("on", "off"),
                        help="V precision over a split history in one launch (on) or two (off) "
                             "(ROW1_TUNING['vprec_lookback'])")
    parser.add_argument("--vprec-optimistic", nargs="+", default=["on" if ROW1_TUNING["vprec_optimistic"] else "off"],
                        choices=("on", "off"),
                        help="V precision over a split history as an optimistic value pass and a check that reruns "
                             "the splits whose hot set changes (on), or after a page-maxima pass (off) "
                             "(ROW1_TUNING['vprec_optimistic'])")
    parser.add_argument("--static-read", default=StaticDenseLayer.read_method,
                        choices=("auto", "sdpa", "kernel", "matmul"),
                        help="how a static dense cell reads its storage (StaticDenseLayer.read_method)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens must be >= 2 (one decode step to time), got {args.new_tokens}")
    if any(c <= args.new_tokens for c in args.context):
        raise SystemExit(f"--context must each exceed --new-tokens ({args.new_tokens}), got {args.context}")
    if args.peers_after and not args.peers:
        raise SystemExit("--peers-after needs --peers")
    modes = [m for m in MODES if m in args.modes or (m == "static" and args.static) or (m == "graph" and args.graph)]
    compile_config = parse_compile_config(args.peer_compile) if args.peer_compile else None
    reference: dict[tuple, torch.Tensor] = {}
    StaticDenseLayer.read_method = args.static_read
    device = args.device
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    # a row's time, estimated: its prefill (the slowest prefill seconds per row and token so far, times batch x
    # context) plus the median of the rest of the rows so far (warm-up, capture, decode: about constant)
    rate, fixed = [0.0], []
    rows: list[dict] = []

    def add(row: dict, seconds: float) -> None:
        if row.get("prefill_s") is not None:
            rate[0] = max(rate[0], row["prefill_s"] / (row["batch"] * row["context"]))
            fixed.append(max(0.0, seconds - row["prefill_s"]))
        row["elapsed_s"] = round(time.perf_counter() - t0, 1)
        print(row, flush=True)
        rows.append(row)
        write_rows(args.out, rows)  # row by row: a run stopped by a time limit keeps what finished

    def late(batch: int, context: int) -> bool:
        if args.deadline_s is None:
            return False
        rest = sorted(fixed)[len(fixed) // 2] if fixed else 0.0
        return time.perf_counter() - t0 + rate[0] * batch * context + rest > args.deadline_s

    def skipped(shape: str, cache: str, mode: str, batch: int, context: int) -> dict:
        return {"shape": shape, "cache": cache, "mode": mode, "batch": batch, "context": context, "status": "deadline",
                "model": "plain Qwen2 peer" if mode == "peer" else "looped"}

    for shape in args.shapes:
        model = build(shape, dtype, "meta" if args.peers_only else device)
        extra = {"init_scale": 0.0} if shape.startswith("huginn") else {}
        warm = torch.randint(1, model.config.vocab_size, (1, 64), device=device)
        if not args.peers_only:
            model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra)
        for cache_name in args.caches if not args.peers_only else []:
            for context, batch in itertools.product(args.context, args.batches):
                for mode, on, fuse, pdl, gemv, fuse_rope, fuse_kv, defer, shared, one, whole, look, opt in (
                    itertools.product(
                        modes, args.fused, args.fuse_silu, args.pdl, args.gemv, args.fuse_rope, args.fuse_kv,
                        args.defer_stop, args.shared_read, args.one_launch, args.whole_source, args.vprec_lookback,
                        args.vprec_optimistic,
                    )
                ):
                    if late(batch, context):
                        rows.append(skipped(shape, cache_name, mode, batch, context))
                        write_rows(args.out, rows)
                        continue
                    start = time.perf_counter()
                    before = (PDL["enabled"], dict(GEMV_TUNING), StaticCodedSharedLayer.history_read, dict(TAIL_TUNING),
                              StaticCodedSharedLayer.whole_source, dict(ROW1_TUNING))
                    StaticCodedSharedLayer.whole_source = whole == "on"
                    ROW1_TUNING["vprec_lookback"] = look == "on"
                    ROW1_TUNING["vprec_optimistic"] = opt == "on"
                    if one == "off":
                        TAIL_TUNING["final_slots"] = 0
                    PDL["enabled"] = pdl == "on"
                    StaticCodedSharedLayer.history_read = shared
                    GEMV_TUNING["fuse_silu"], GEMV_TUNING["enabled"] = fuse == "on", gemv == "on"
                    GEMV_TUNING["fuse_rope"], GEMV_TUNING["fuse_kv"] = fuse_rope == "on", fuse_kv == "on"
                    try:
                        with contextlib.nullcontext() if on == "on" else fused.disabled():
                            row = run_one(model, shape, cache_name, batch, context, args.new_tokens, device,
                                          count_kernels=args.count_kernels, mode=mode, reference=reference,
                                          fused_ops=on == "on", timing=args.timing,
                                          warmup_prompt=args.warmup_prompt, defer_stop=defer == "on")
                    finally:
                        PDL["enabled"] = before[0]
                        GEMV_TUNING.update(before[1])
                        StaticCodedSharedLayer.history_read = before[2]
                        TAIL_TUNING.update(before[3])
                        StaticCodedSharedLayer.whole_source = before[4]
                        ROW1_TUNING.update(before[5])
                    add(row, time.perf_counter() - start)
        if args.peers:
            peer = peer_model(model, dtype, device)
            del model
            reset_peak(device)
            peer.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0)
            compiled: dict = {}
            if args.peers_after and "static" in args.peers:
                compiled = precompile_static_peer(
                    peer, shape, args.batches, args.context, device, compile_config=compile_config,
                    warmup_prompt=args.warmup_prompt or 16,
                    progress=lambda partial: write_rows(args.out, [*rows, partial]),
                )
                print("static peer compiled:", compiled, flush=True)
                write_rows(args.out, [*rows, {"shape": shape, "cache": "static", "mode": "peer",
                                              "model": "plain Qwen2 peer", "status": f"compiled; waiting for {args.peers_after}",
                                              "compiled": {f"{k[0]}x{k[1]}" if isinstance(k, tuple) else k: v
                                                           for k, v in compiled.items()}}])
            waited = wait_for(args.peers_after, args.peers_wait_s) if args.peers_after else None
            for name in args.peers:
                for context, batch in itertools.product(args.context, args.batches):
                    if late(batch, context):
                        rows.append(skipped(shape, name, "peer", batch, context))
                        write_rows(args.out, rows)
                        continue
                    start = time.perf_counter()
                    first = compiled.get((batch, context), {}) if name == "static" else {}
                    row = run_one(peer, shape, name, batch, context, args.new_tokens, device, peer=True,
                                  count_kernels=args.count_kernels, timing=args.timing,
                                  warmup_prompt=args.warmup_prompt,
                                  compile_config=first.get("compile_config", compile_config),
                                  quantized_backends=tuple(args.quantized_backends))
                    if first:  # compiled before the wait: the row's own warm-up re-records the CUDA graphs
                        row["rewarm_s"] = row.pop("compile_warmup_s", None)
                        row["compile_warmup_s"] = first.get("compile_warmup_s")
                        if "error" in first:
                            row["precompile_error"] = first["error"]
                        if compiled.get("fallback"):
                            row["compile_fallback"] = compiled["fallback"]
                    if waited is not None:
                        row["waited_s"] = waited
                    add(row, time.perf_counter() - start)
            del peer
        else:
            del model
        reset_peak(device)
    print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
