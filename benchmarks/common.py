"""Shared pieces of the benchmarks: environment header, real-size configs, timing, result rows."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_loopcache
from hf_loopcache import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM

RESULTS = Path(__file__).parent / "results"

#: real-size shapes (random weights: speed and memory do not depend on the values)
SHAPES: dict[str, Any] = {
    # the configs' defaults are the released shapes (Ouro-1.4B; Huginn-0125); Ouro-2.6B has 48 layers
    "ouro-1.4b": lambda: OuroForCausalLM(OuroConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "ouro-2.6b": lambda: OuroForCausalLM(
        OuroConfig(num_hidden_layers=48, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ),
    "huginn-0125": lambda: HuginnForCausalLM(HuginnConfig(bos_token_id=65504, eos_token_id=65505, pad_token_id=65509)),
    # small shapes to check the benchmark code itself on a CPU
    "micro-ouro": lambda: OuroForCausalLM(
        OuroConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            total_ut_steps=4,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    ),
    "micro-huginn": lambda: HuginnForCausalLM(
        HuginnConfig(
            n_embd=64,
            n_heads=4,
            n_layers_in_prelude=1,
            n_layers_in_recurrent_block=2,
            n_layers_in_coda=1,
            intermediate_size=128,
            vocab_size=512,
            mean_recurrence=4,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    ),
}


_ROW1_OVERRIDES: dict[str, Any] = {}


def apply_row1_tuning(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` overrides of `triton_ops.coded_attention.ops.ROW1_TUNING` for a whole run (an A/B of coded
    attention's settings inside the model, one process per side), applied in place and recorded by `environment()`
    under `row1_tuning`. VALUE as `ops.tuning_value` reads it (`none`, `true` / `false`, an int, else a string); KEY one of the dict's keys."""
    from triton_ops.coded_attention.ops import ROW1_TUNING, tuning_value

    got: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in ROW1_TUNING:
            raise SystemExit(f"--row1-tuning takes KEY=VALUE with KEY one of {sorted(ROW1_TUNING)}, got {pair!r}")
        got[key] = tuning_value(raw)
    ROW1_TUNING.update(got)
    _ROW1_OVERRIDES.update(got)
    return got


def environment() -> dict[str, Any]:
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_loopcache": hf_loopcache.__version__,
        "python": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        env["gpu_name"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        # the caching allocator's settings decide how much of a memory budget fragmentation takes
        env["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if _ROW1_OVERRIDES:
        env["row1_tuning"] = dict(_ROW1_OVERRIDES)
    return env


def build(shape: str, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    with torch.device(device):
        model = SHAPES[shape]()
    return model.to(dtype).eval()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.startswith("cuda") else None


def timed(fn, device: str) -> tuple[Any, float]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


class StepClock:
    """A logits processor that marks each generated token; the first mark ends the prefill, the span from the first to
    the last covers `len(times) - 1` decode steps.

    On CUDA a mark is a timing event recorded on the current stream, so `times` are when the GPU reached each token
    and the clock adds no host synchronisation: the step keeps `generate`'s own one (its stop check), and what is
    timed is the step a user's `generate` runs. `sync=True` (the clock of the suite's runs up to session 20)
    synchronises at each mark and reads the host clock instead; that moves the host's wait from the stop check to the
    logits processors, so the work between them (processors, argmax, the token's concatenation, the stopping criteria)
    runs while the GPU idles and is counted in the step. Elsewhere (CPU) the host clock. CPU time (`process_time`) is
    noted at each mark either way."""

    def __init__(self, device: str, *, sync: bool = False) -> None:
        self.device, self.sync, self.cpu = device, sync, []
        self._host: list[float] = []
        self._events: list[Any] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.startswith("cuda") and not self.sync:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        else:
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            self._host.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return scores

    @property
    def times(self) -> list[float]:
        """Seconds of each mark (events: from the first mark; the host clock: `perf_counter`)."""
        if not self._events:
            return list(self._host)
        self._events[-1].synchronize()
        return [self._events[0].elapsed_time(e) / 1000 for e in self._events]

    def decode(self) -> tuple[int, float, float]:
        """(decode steps, wall seconds, CPU seconds) from the first generated token to the last."""
        times = self.times
        return len(times) - 1, times[-1] - times[0], self.cpu[-1] - self.cpu[0]

    def median_step_s(self) -> float:
        """The median decode step in seconds (a one-off step, e.g. a first kernel compile, does not move it)."""
        times = self.times
        steps = sorted(b - a for a, b in zip(times, times[1:]))
        return steps[len(steps) // 2] if len(steps) % 2 else (steps[len(steps) // 2 - 1] + steps[len(steps) // 2]) / 2


def write_rows(name: str, rows: list[dict[str, Any]]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=2) + "\n")
    return path
