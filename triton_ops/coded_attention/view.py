"""`CellView`: what one cache cell stores, as attention reads it. The contract between a cache and the op.

A cell's positions `[0, length)` are held in up to three stretches, plus the `q` new tokens of the forward:

```
position:   0 ........ S ............................ length ....... length + q
            | sink     | history (codes or BF16)  |                |
            |          |            | window (BF16, own)          | new tokens (BF16)
                       S      window_start    history_end[b, i]
```

- **sink** `[0, S')`, `S' = min(history_start, length)`: the cell's own keys and values at full precision;
- **history** `[history_start, history_start + T_hist)`: KIVI codes (`QuantizedKeys` / `QuantizedValues` of
  `triton_ops.quant`, own or a source cell's) or a BF16 plane (a source cell's buffers); it may hold more positions
  than any query reads;
- **window** `[window_start, length)`: the cell's own recent positions at full precision;
- **new** `[length, length + q)`: the keys and values of the forward's new tokens.

Query `i` of row `b` (at position `length + i`) reads position `j` from

- the sink if `j < S'`,
- the history if `history_start <= j < history_end[b, i]`,
- the window if `history_end[b, i] <= j < length`,
- the new tokens if `length <= j <= length + i`,

and never a padded key (`key_valid[b, j]` False) except itself. So `history_end[b, i]` must lie in
`[max(history_start, window_start), min(history_start + T_hist, length)]`; a query reads each position once.

**Device-side lengths** (a static cache, whose decode step is captured in a CUDA graph): `length` is a one-element
integer tensor on the device instead of an int, and every tensor keeps its shape and address from step to step:

- the sink is the whole `[B, H_kv, S, D]` buffer (`S = history_start`); positions `>= length` are not read;
- the history is every preallocated page; a query reads it below its `history_end` only (as always);
- the window is a *ring* `[B, H_kv, C, D]` (`window_start` None): position `p` sits in slot `p % C`, and the ring
  holds the `C` most recent positions below `length`, so slot `c` holds position
  `length - 1 - ((length - 1 - c) mod C)`; a query reads the slots whose position is `>= history_end` (and `>= 0`).
  `history_end >= length - C` is the caller's to keep (older positions are read from the history).

Nothing about the view is then read back to the host: lengths, page counts and window boundaries are masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from triton_ops.quant import QuantizedKeys, QuantizedValues

__all__ = ["CellView"]


def _check_kv_tensor(t: object, name: str, ref: Tensor, length: int | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor of shape [B, H_kv, L, D], got {type(t).__name__}")
    if t.ndim != 4 or t.shape[0] != ref.shape[0] or t.shape[1] != ref.shape[1] or t.shape[3] != ref.shape[3]:
        raise ValueError(
            f"`{name}` must have shape [B, H_kv, L, D] = [{ref.shape[0]}, {ref.shape[1]}, L, {ref.shape[3]}], "
            f"got {tuple(t.shape)}"
        )
    if length is not None and t.shape[2] != length:
        raise ValueError(f"`{name}` must hold {length} positions, got {t.shape[2]}")
    if t.dtype != ref.dtype:
        raise TypeError(f"`{name}` must have the dtype of `new_key` ({ref.dtype}), got {t.dtype}")
    if t.shape[2] and t.stride(-1) != 1:
        raise ValueError(f"`{name}` must have stride 1 in its last dim, got strides {t.stride()}")
    return t


@dataclass(frozen=True, eq=False)
class CellView:
    """One cell's stored keys and values plus the forward's new tokens, as `coded_attention` reads them.

    Every tensor is a view of the cell's own storage (or of its source cell's): no field is a decoded copy. Tensors
    may be strided in every dim but the last (stride 1).

    Args:
        new_key (`torch.Tensor` of shape `[B, H_kv, q, D]`): keys of the new tokens (positions `[length, length+q)`),
            in the model's dtype (bf16, fp16 or fp32); every other full-precision tensor has this dtype.
        new_value (`torch.Tensor` of shape `[B, H_kv, q, D]`): their values.
        length (`int` or `torch.Tensor`): cached positions before the new tokens; a one-element integer tensor on
            the device for device-side lengths (then the window is a ring and `window_start` is None: see above).
        history_end (`torch.Tensor` of shape `[B, q]`, integer dtype): per row and query, the end of the stretch read
            from the history (the engine's boundary `H(t)`, RIPE Eq. 9); from there on the window is read.
        sink_key (`torch.Tensor` of shape `[B, H_kv, S', D]`, *optional*): own keys of positions `[0, S')`,
            `S' = min(history_start, length)`. None when `S' == 0`.
        sink_value (`torch.Tensor` of shape `[B, H_kv, S', D]`, *optional*): their values.
        history_start (`int`, *optional*, defaults to 0): `S`, the first history position (the plan's sink size).
        history_key (`QuantizedKeys` or `torch.Tensor` `[B, H_kv, T_hist, D]`, *optional*): keys of positions
            `[history_start, history_start + T_hist)`: codes (per channel over pages of `group_size` tokens, the
            first page starting at `history_start`) or a full-precision plane. None when nothing is read from history.
        history_value (`QuantizedValues` or `torch.Tensor` `[B, H_kv, T_hist, D]`, *optional*): values of the same
            positions, of the same kind (codes with codes, a plane with a plane); INT4 codes carry the `hi`/`lo` planes.
        window_start (`int`, *optional*, defaults to `length`): first position of the window (None with device-side
            lengths).
        window_key (`torch.Tensor` of shape `[B, H_kv, length - window_start, D]`, *optional*): own keys of positions
            `[window_start, length)`. None when the window is empty. With device-side lengths: the ring
            `[B, H_kv, C, D]`.
        window_value (`torch.Tensor` of shape `[B, H_kv, length - window_start, D]`, *optional*): their values.
        key_valid (`torch.BoolTensor` of shape `[B, >= length + q]`, *optional*): True where the position holds a
            real token; None when every position is real.
        window_reach (`int`, *optional*): with device-side lengths, the most ring positions a row reads while its
            window holds no holes (at most a decoding cell's ring, `W + 2P` for a coded one). The launcher sizes the
            window's programs for this stretch, not for the ring (a self-speculative batch's ring is sized for a hole
            after every real token, several times longer), and those programs loop over the rest where holes make a
            row's stretch longer. None: the ring's capacity.
    """

    new_key: Tensor
    new_value: Tensor
    length: int | Tensor
    history_end: Tensor
    sink_key: Tensor | None = None
    sink_value: Tensor | None = None
    history_start: int = 0
    history_key: QuantizedKeys | Tensor | None = None
    history_value: QuantizedValues | Tensor | None = None
    window_start: int | None = None
    window_key: Tensor | None = None
    window_value: Tensor | None = None
    key_valid: Tensor | None = None
    window_reach: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.new_key, Tensor) or self.new_key.ndim != 4:
            raise ValueError(f"`new_key` must be a [B, H_kv, q, D] tensor, got {getattr(self.new_key, 'shape', None)}")
        ref = self.new_key
        _check_kv_tensor(self.new_value, "new_value", ref, ref.shape[2])
        if isinstance(self.length, Tensor):
            self._check_device_lengths()
            return
        for name in ("length", "history_start"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative int, got {value!r}")
        if self.window_reach is not None:
            raise ValueError("`window_reach` describes a ring window: it needs a tensor `length` (device-side lengths)")
        if self.window_start is None:
            object.__setattr__(self, "window_start", self.length)
        if not self.history_start <= self.window_start <= self.length and not (
            self.length <= self.history_start and self.window_start == self.length
        ):
            raise ValueError(
                f"need `history_start` ({self.history_start}) <= `window_start` ({self.window_start}) <= `length` "
                f"({self.length})"
            )
        sink_len = min(self.history_start, self.length)
        if (self.sink_key is None) != (self.sink_value is None):
            raise ValueError("`sink_key` and `sink_value` must both be given or both be None")
        if self.sink_key is None:
            if sink_len:
                raise ValueError(f"the sink holds positions [0, {sink_len}): `sink_key`/`sink_value` are needed")
        else:
            _check_kv_tensor(self.sink_key, "sink_key", ref, sink_len)
            _check_kv_tensor(self.sink_value, "sink_value", ref, sink_len)
        window_len = self.length - self.window_start
        if (self.window_key is None) != (self.window_value is None):
            raise ValueError("`window_key` and `window_value` must both be given or both be None")
        if self.window_key is None:
            if window_len:
                raise ValueError(f"the window holds {window_len} positions: `window_key`/`window_value` are needed")
        else:
            _check_kv_tensor(self.window_key, "window_key", ref, window_len)
            _check_kv_tensor(self.window_value, "window_value", ref, window_len)
        hk, hv = self.history_key, self.history_value
        if (hk is None) != (hv is None):
            raise ValueError("`history_key` and `history_value` must both be given or both be None")
        if isinstance(hk, QuantizedKeys) or isinstance(hv, QuantizedValues):
            if not (isinstance(hk, QuantizedKeys) and isinstance(hv, QuantizedValues)):
                raise TypeError(
                    "coded history needs `history_key` as QuantizedKeys and `history_value` as QuantizedValues, got "
                    f"{type(hk).__name__} and {type(hv).__name__}"
                )
            if hk.num_tokens != hv.num_tokens or hk.nbits != hv.nbits:
                raise ValueError(
                    f"history keys and values must hold the same tokens and bits, got {hk.num_tokens} / {hk.nbits} "
                    f"and {hv.num_tokens} / {hv.nbits}"
                )
            if hk.codes.shape[:2] != ref.shape[:2] or hk.head_dim != ref.shape[3]:
                raise ValueError(
                    f"history codes must be for [B, H_kv] = {tuple(ref.shape[:2])} and D = {ref.shape[3]}, got "
                    f"{tuple(hk.codes.shape[:2])} and D = {hk.head_dim}"
                )
        elif hk is not None:
            _check_kv_tensor(hk, "history_key", ref)
            _check_kv_tensor(hv, "history_value", ref, hk.shape[2])
        b, q = ref.shape[0], ref.shape[2]
        he = self.history_end
        if not isinstance(he, Tensor) or he.dtype.is_floating_point or he.dtype == torch.bool:
            raise TypeError(f"`history_end` must be an integer tensor of shape [B, q] = [{b}, {q}], got {he!r}")
        if tuple(he.shape) != (b, q):
            raise ValueError(f"`history_end` must have shape [B, q] = [{b}, {q}], got {tuple(he.shape)}")
        kv = self.key_valid
        if kv is not None and (
            not isinstance(kv, Tensor)
            or kv.dtype != torch.bool
            or kv.ndim != 2
            or kv.shape[0] != b
            or kv.shape[1] < self.length + q
        ):
            raise ValueError(
                f"`key_valid` must be a bool tensor of shape [B, >= length + q] = [{b}, >= {self.length + q}], got "
                f"{getattr(kv, 'dtype', type(kv).__name__)} {tuple(getattr(kv, 'shape', ()))}"
            )

    def _check_device_lengths(self) -> None:
        """Shapes only (reading a device value would sync): sink of `history_start` positions, a ring window."""
        ref, length = self.new_key, self.length
        if length.dtype.is_floating_point or length.dtype == torch.bool or length.numel() != 1:
            raise TypeError(f"a tensor `length` must hold one integer, got {length.dtype} {tuple(length.shape)}")
        if isinstance(self.history_start, bool) or not isinstance(self.history_start, int) or self.history_start < 0:
            raise ValueError(f"`history_start` must be a non-negative int, got {self.history_start!r}")
        if self.window_start is not None:
            raise ValueError("with a tensor `length` the window is a ring: `window_start` must be None")
        reach = self.window_reach
        if reach is not None and (isinstance(reach, bool) or not isinstance(reach, int) or reach < 0):
            raise ValueError(f"`window_reach` must be None or a non-negative int, got {reach!r}")
        pairs = (("sink", self.sink_key, self.sink_value), ("window", self.window_key, self.window_value))
        for name, k, v in pairs:
            if (k is None) != (v is None):
                raise ValueError(f"`{name}_key` and `{name}_value` must both be given or both be None")
        if self.history_start and self.sink_key is None:
            raise ValueError(f"the sink holds positions [0, {self.history_start}): `sink_key`/`sink_value` are needed")
        if self.sink_key is not None:
            _check_kv_tensor(self.sink_key, "sink_key", ref, self.history_start)
            _check_kv_tensor(self.sink_value, "sink_value", ref, self.history_start)
        if self.window_key is not None:
            _check_kv_tensor(self.window_key, "window_key", ref)
            _check_kv_tensor(self.window_value, "window_value", ref, self.window_key.shape[2])
        hk, hv = self.history_key, self.history_value
        if (hk is None) != (hv is None) or isinstance(hk, QuantizedKeys) != isinstance(hv, QuantizedValues):
            raise TypeError("`history_key` / `history_value` must both be codes, both tensors, or both None")
        if isinstance(hk, Tensor):
            _check_kv_tensor(hk, "history_key", ref)
            _check_kv_tensor(hv, "history_value", ref, hk.shape[2])
        b, q = ref.shape[0], ref.shape[2]
        he = self.history_end
        if not isinstance(he, Tensor) or he.dtype.is_floating_point or tuple(he.shape) != (b, q):
            raise ValueError(f"`history_end` must be an integer tensor of shape [B, q] = [{b}, {q}], got {he!r}")
        kv = self.key_valid
        if kv is not None and (kv.dtype != torch.bool or kv.ndim != 2 or kv.shape[0] != b):
            raise ValueError(f"`key_valid` must be a bool tensor of shape [B, >= length + q], got {kv!r}")

    # ------------------------------------------------------------------------------------------------ derived
    @property
    def device_lengths(self) -> bool:
        """True when `length` is a device tensor (sink buffer, all pages, a ring window; see the module docstring)."""
        return isinstance(self.length, Tensor)

    @property
    def ring_capacity(self) -> int:
        """Slots of the ring window (device-side lengths), 0 without one."""
        return 0 if self.window_key is None else self.window_key.shape[2]

    @property
    def batch_size(self) -> int:
        return self.new_key.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.new_key.shape[1]

    @property
    def head_dim(self) -> int:
        return self.new_key.shape[3]

    @property
    def query_length(self) -> int:
        return self.new_key.shape[2]

    @property
    def sink_length(self) -> int:
        return 0 if self.sink_key is None else self.sink_key.shape[2]

    @property
    def history_length(self) -> int:
        """Positions the history holds (`T_hist`); queries read a prefix of them."""
        if self.history_key is None:
            return 0
        if isinstance(self.history_key, QuantizedKeys):
            return self.history_key.num_tokens
        return self.history_key.shape[2]

    @property
    def is_coded(self) -> bool:
        """True when the history is codes (INT4 / INT2), False for a full-precision plane or no history."""
        return isinstance(self.history_key, QuantizedKeys)

    @property
    def history_nbits(self) -> int | None:
        """4 or 2 for coded history, None otherwise."""
        return self.history_key.nbits if isinstance(self.history_key, QuantizedKeys) else None

    @property
    def page_size(self) -> int | None:
        """Tokens per key page of coded history (also the V-precision page), None otherwise."""
        return self.history_key.group_size if isinstance(self.history_key, QuantizedKeys) else None
