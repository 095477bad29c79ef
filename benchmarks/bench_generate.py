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
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from typing import Any

import torch

from benchmarks.common import build, peak_gib, reset_peak, write_rows
from hf_loopcache import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache
from hf_loopcache.cache.layers.static import StaticDenseLayer
from triton_ops import fused

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


def _peer_kwargs(model: Any, name: str) -> dict[str, Any]:
    if name == "dynamic":
        return {}
    if name == "static":
        return {"cache_implementation": "static"}
    if name == "quantized":
        from transformers import QuantizedCache

        return {"past_key_values": QuantizedCache(backend="quanto", config=model.config, nbits=4)}
    raise ValueError(f"`--peers` must name some of {PEERS}, got {name!r}")


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
) -> dict[str, Any]:
    vocab = model.config.vocab_size
    prompt_len = context - new_tokens
    torch.manual_seed(batch)
    ids = torch.randint(1, vocab, (batch, prompt_len), device=device)
    mask = torch.ones_like(ids)
    row: dict[str, Any] = {
        "shape": shape,
        "cache": cache_name,
        "mode": "peer" if peer else mode,
        "static_read": StaticDenseLayer.read_method if mode != "eager" and not peer else None,
        "fused_ops": fused_ops if not peer else None,
        "model": "plain Qwen2 peer" if peer else "looped",
        "batch": batch,
        "context": context,
        "prompt": prompt_len,
        "new_tokens": new_tokens,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    if not peer:
        row["layout"] = model.loop_layout.describe()
        row["kv_bytes_per_token_formula"] = model.loop_layout.full_bytes_per_token()
    extra = {"init_scale": 0.0} if shape.startswith("huginn") and not peer else {}
    gen = dict(attention_mask=mask, do_sample=False, pad_token_id=0, **extra)
    static_cache = None
    if not peer and mode != "eager":
        static_cache = CACHES[cache_name](model, static=True, max_batch_size=batch, max_cache_len=context)
        gen["disable_compile"] = mode == "static"

    def generate(tokens: int) -> tuple[torch.Tensor, Any]:
        if peer:
            kwargs = _peer_kwargs(model, cache_name)
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, return_dict_in_generate=True,
                                 **kwargs, **gen)
            return out.sequences, out.past_key_values
        cache = CACHES[cache_name](model) if static_cache is None else static_cache
        cache.reset()
        out = model.generate(ids, cache=cache, max_new_tokens=tokens, min_new_tokens=tokens, **gen)
        return out, cache

    try:
        if peer and cache_name == "static":  # compile warm-up at this batch size, reported apart
            _, t_warm, _ = _timed(lambda: generate(4), device)
            row["compile_warmup_s"] = round(t_warm, 2)
        else:  # warm-up at this shape: Triton compiles a kernel per argument
            # specialisation at its first launch (eager rows included), and a graph is captured in `graph` mode
            _, t_warm, _ = _timed(lambda: generate(4), device)
            row["warmup_s"] = round(t_warm, 2)
            if mode == "graph" and static_cache is not None:
                row["capture_s"] = [step["capture_s"] for step in static_cache.captured_steps()]
        reset_peak(device)
        prefill_only, t_prefill, c_prefill = _timed(lambda: generate(1), device)
        del prefill_only  # free its cache before the full run
        reset_peak(device)
        (out, cache), t_total, c_total = _timed(lambda: generate(new_tokens), device)
        steps = new_tokens - 1
        decode = t_total - t_prefill
        row.update(
            status="ok",
            prefill_s=round(t_prefill, 4),
            total_s=round(t_total, 4),
            decode_s=round(decode, 4),
            decode_tokens_per_s=round(batch * steps / decode, 2),
            ms_per_decode_step=round(1000 * decode / steps, 3),
            cpu_ms_per_decode_step=round(1000 * (c_total - c_prefill) / steps, 3),
            peak_memory_gib=peak_gib(device),
            generated=int(out.shape[1] - prompt_len),
        )
        if reference is not None and not peer:
            key = (shape, cache_name, batch, context, new_tokens, fused_ops)
            reference[(*key, mode)] = out.cpu()
            for other in ("eager", "static"):
                if other != mode and (*key, other) in reference and not (mode == "static" and other != "eager"):
                    seen = reference[(*key, other)]
                    row[f"tokens_equal_{other}"] = bool(torch.equal(seen, out.cpu()))
                    row[f"first_mismatch_{other}"] = _first_mismatch(seen, out.cpu(), prompt_len)
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
            row["kernels_per_decode_step"] = round((k_total - k_prefill) / steps, 1)
    except torch.OutOfMemoryError as err:
        needed = model.loop_layout.full_bytes(context) * batch if cache_name == "full" and not peer else None
        row.update(status="oom", error=str(err).splitlines()[0][:200], kv_bytes_needed_formula=needed)
    except (ImportError, ValueError, RuntimeError) as err:
        if not peer:
            raise
        row.update(status="unavailable", error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    reset_peak(device)
    return row


def _first_mismatch(a: torch.Tensor, b: torch.Tensor, start: int) -> int | None:
    """The first generated step at which two greedy outputs differ (None when equal)."""
    differ = (a[:, start:] != b[:, start:]).any(dim=0).nonzero()
    return None if differ.numel() == 0 else int(differ[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["ouro-1.4b", "huginn-0125"], help="model shapes")
    parser.add_argument("--caches", nargs="+", default=["full"], choices=sorted(CACHES), help="looped-model caches")
    parser.add_argument("--peers", nargs="*", default=[], choices=PEERS, help="transformers caches on the plain peer")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="batch sizes")
    parser.add_argument("--context", type=int, nargs="+", default=[8192], help="prompt + new tokens (one or more)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
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
    parser.add_argument("--static-read", default=StaticDenseLayer.read_method, choices=("sdpa", "kernel", "matmul"),
                        help="how a static dense cell reads its storage (StaticDenseLayer.read_method)")
    args = parser.parse_args(argv)
    modes = [m for m in MODES if m in args.modes or (m == "static" and args.static) or (m == "graph" and args.graph)]
    reference: dict[tuple, torch.Tensor] = {}
    StaticDenseLayer.read_method = args.static_read
    device = args.device
    dtype = getattr(torch, args.dtype)
    rows = []
    for shape in args.shapes:
        model = build(shape, dtype, device)
        warm = torch.randint(1, model.config.vocab_size, (1, 64), device=device)
        extra = {"init_scale": 0.0} if shape.startswith("huginn") else {}
        model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra)
        for cache_name in args.caches:
            for context, batch in itertools.product(args.context, args.batches):
                for mode, on in itertools.product(modes, args.fused):
                    with contextlib.nullcontext() if on == "on" else fused.disabled():
                        row = run_one(model, shape, cache_name, batch, context, args.new_tokens, device,
                                      count_kernels=args.count_kernels, mode=mode, reference=reference,
                                      fused_ops=on == "on")
                    print(row, flush=True)
                    rows.append(row)
                    write_rows(args.out, rows)  # row by row: a run stopped by a time limit keeps what finished
        if args.peers:
            peer = peer_model(model, dtype, device)
            del model
            reset_peak(device)
            peer.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0)
            for name in args.peers:
                for context, batch in itertools.product(args.context, args.batches):
                    row = run_one(peer, shape, name, batch, context, args.new_tokens, device, peer=True,
                                  count_kernels=args.count_kernels)
                    print(row, flush=True)
                    rows.append(row)
                    write_rows(args.out, rows)  # row by row: a run stopped by a time limit keeps what finished
            del peer
        else:
            del model
        reset_peak(device)
    print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
