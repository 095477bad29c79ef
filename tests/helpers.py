"""Tiny random models of both architectures (fp32, CPU), built from configs, never downloaded."""

from __future__ import annotations

import torch

from hf_loopcache import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM


def tiny_ouro(seed: int = 0, **overrides) -> OuroForCausalLM:
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        total_ut_steps=3,
        max_position_embeddings=512,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    )
    kwargs.update(overrides)
    return OuroForCausalLM(OuroConfig(**kwargs)).eval()


def tiny_huginn(seed: int = 0, **overrides) -> HuginnForCausalLM:
    torch.manual_seed(seed)
    kwargs = dict(
        n_embd=32,
        n_heads=4,
        n_layers_in_prelude=2,
        n_layers_in_recurrent_block=2,
        n_layers_in_coda=2,
        intermediate_size=48,
        vocab_size=64,
        mean_recurrence=4,
        block_size=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    model = HuginnForCausalLM(HuginnConfig(**kwargs)).eval()
    with torch.no_grad():  # the official init is tiny; larger weights make every test more sensitive
        for name, p in model.named_parameters():
            if "norm" in name or "ln_f" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def make_model(arch: str, seed: int = 0, **overrides):
    return tiny_ouro(seed, **overrides) if arch == "ouro" else tiny_huginn(seed, **overrides)


def call_kwargs(arch: str) -> dict:
    """Extra forward/generate kwargs that make a model deterministic (Huginn: zero initial state)."""
    return {} if arch == "ouro" else {"init_scale": 0.0}


@torch.no_grad()
def teacher_forced_logprob(model, sequence: torch.Tensor, prompt_length: int, cache, **kwargs) -> float:
    """Sum of log p(token) of `sequence[0, prompt_length:]` when it is fed through `cache` one token at a time: the
    score beam search must report for that beam (`length_penalty=0`) if its cache rows followed the beam."""
    logits = model(sequence[:, :prompt_length], past_key_values=cache, use_cache=True, **kwargs).logits[:, -1]
    total = 0.0
    for t in range(prompt_length, sequence.shape[1]):
        total += float(torch.log_softmax(logits.double(), -1)[0, sequence[0, t]])
        if t + 1 < sequence.shape[1]:
            logits = model(sequence[:, t : t + 1], past_key_values=cache, use_cache=True, **kwargs).logits[:, -1]
    return total


# ------------------------------------------------------------------ CUDA graphs stood in for on the CPU
def device_state(cache) -> list[torch.Tensor]:
    """Every tensor a captured step of a static `LoopCache` may write: the cache's device-side lengths, key validity
    and ring starts, and each cell's storage (dense buffers, sink, ring bounds, codes, the flush's coded slots)."""
    names = ("_length_t", "_valid_t", "_source_length_t")
    tensors = [t for t in (getattr(cache, name, None) for name in names) if t is not None]
    for layer in cache.cells:
        for name in ("k", "v", "sink_k", "sink_v", "floor_t", "coded_t"):
            if getattr(layer, name, None) is not None:
                tensors.append(getattr(layer, name))
        qk, qv = getattr(layer, "qk", None), getattr(layer, "qv", None)
        if qk is not None and qv is not None:
            tensors += [qk.codes, qk.scale, qk.zero, qv.hi, qv.scale, qv.zero] + ([] if qv.lo is None else [qv.lo])
    return tensors


def host_state(cache) -> list[dict]:
    """Every cell's host-side scalars (lengths, ring bounds, floors: the Python ints, bools and floats a step's host
    code reads and writes), by flat index. Written out here, not `LoopCache._host_state`, so that the tests of what a
    recording restores do not read it through the code they test."""
    return [
        {name: value for name, value in vars(layer).items() if type(value) in (int, bool, float)}
        for layer in cache.cells
    ]


def restore_host_state(cache, state: list[dict]) -> None:
    for layer, saved in zip(cache.cells, state):
        vars(layer).update(saved)


class ReplayedStep:
    """A stand-in for a CUDA graph on the CPU: a replay reruns the recorded step with the host state (every cell's
    host length, ring bounds and floors) frozen at its recording, as a real graph replays kernels whose host-side
    arguments were fixed then, and leaves the host state as it found it, as a real replay runs no host code; only
    device state (tensors) moves on. A step that read a host value would go wrong here as on the GPU."""

    def __init__(self, fn, out, cache, host: list[dict]):
        self.fn, self.out, self.cache = fn, out, cache
        self.host = host  # at the recording, before it ran
        self.speculating = cache.is_speculating  # the cache-wide read mode a recording fixes too
        self.replays = 0

    def replay(self):
        now, speculating = host_state(self.cache), self.cache._speculating
        restore_host_state(self.cache, self.host)
        self.cache._speculating = self.speculating
        with torch.no_grad():
            self.out.copy_(self.fn())
        restore_host_state(self.cache, now)
        self.cache._speculating = speculating
        self.replays += 1


def stand_in_graphs(monkeypatch) -> None:
    """`DecodeGraphs` on the CPU: captures allowed, the warm-up run inline, the recording run once and undone (a
    recording runs nothing on a real device), its replays by `ReplayedStep`."""
    from hf_loopcache.models._graphs import DecodeGraphs

    def record(self, fn, cache):
        before, host = [t.clone() for t in device_state(cache)], host_state(cache)
        with torch.no_grad():
            out = fn()
        for t, saved in zip(device_state(cache), before):
            t.copy_(saved)
        return ReplayedStep(fn, out, cache, host), out

    monkeypatch.setattr(DecodeGraphs, "_capturable", lambda self, ids: True)
    monkeypatch.setattr(DecodeGraphs, "_warm_up", lambda self, fn: fn())
    monkeypatch.setattr(DecodeGraphs, "_record", record)


def compile_for_sm90(
    fn, constexprs: dict, pointers: dict[str, str], *, floats: tuple[str, ...] = (), aligned: tuple[str, ...] = (),
    **options,
):
    """Compile the `@triton.jit` kernel `fn` for sm_90 with Triton's own compiler and ptxas, on any machine (no GPU):
    the interpreter runs Python, not the compiler, which rejects code the interpreter accepts. `pointers` names each
    `*_ptr` argument's element type (`"bf16"`, `"i64"`, ...), `floats` the fp32 scalars (other scalars are i32),
    `aligned` the arguments given 16-byte divisibility (as a launch with aligned tensors and sizes specialises them);
    `options` are launch options (`num_warps`, `num_stages`). Skips the test when this Triton build has no ptxas."""
    import pytest

    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name.endswith("_ptr"):
            return "*" + pointers[name]
        return "fp32" if name in floats else "i32"

    signature = {name: kind(name) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as err:
        if "ptxas" in str(err).lower():
            pytest.skip(str(err).splitlines()[0])
        raise
