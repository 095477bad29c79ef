"""Pure-PyTorch reference of the KIVI-style key/value codecs of the LoopKV cache.

This module is the **contract** that the Triton codecs must match bit for bit on codes, scales and zero points, and
the CPU (or no-Triton) fallback of the cache. It favours exactness and readability over speed. The storage layout,
the exact order of floating-point operations and the byte model are described in `README.md` next to this file;
the short version:

- Keys are quantized **per channel** over pages of `group_size` consecutive tokens, values **per token** over
  groups of `group_size` consecutive channels (KIVI, Liu et al. 2024; LoopKV §3.1).
- For every group: `scale = (max - min) / (2**nbits - 1)` and `zero = min`, both computed in fp32 and stored as
  fp16. Codes are `clamp(round((x - zero16) / scale16), 0, 2**nbits - 1)` computed in fp32 with the fp16-*rounded*
  scale and zero (the ones dequantization will use); `round` is `torch.round`, i.e. round half to even; a group
  with `scale16 == 0` gets code 0 everywhere.
- Codes are packed little end first along the channel dim into `uint8`. INT4 keys are one 4-bit plane, INT4 values
  two 2-bit planes `hi = c // 4` and `lo = c % 4` (LoopKV §3.3, V precision), INT2 keys and values one 2-bit plane.
- Dequantization is `code * scale + zero` in fp32. A *cold* INT4 value token decodes to the midpoint of its `hi`
  bucket, `4 * hi + 1.5`, so it needs only the `hi` plane (LoopKV Proposition 1: `|v_hot - v_cold| <= 1.5 * scale`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "SUPPORTED_NBITS",
    "QuantizedKeys",
    "QuantizedValues",
    "cold_value_error_bound",
    "dequantize_keys",
    "dequantize_values",
    "fake_quantize_keys",
    "fake_quantize_values",
    "flush_page",
    "kivi_bytes_per_token",
    "pack_codes",
    "quantize_keys",
    "quantize_values",
    "unpack_codes",
]

SUPPORTED_NBITS = (2, 4)
"""Bit widths of the codecs."""

DEFAULT_GROUP_SIZE = 32
"""Tokens per key page and channels per value group (LoopKV uses 32 for both)."""

_COLD_CODE_OFFSET = 1.5
"""A cold INT4 value decodes to `4 * hi + 1.5`, the midpoint of the codes `4*hi .. 4*hi + 3` of its `hi` bucket."""

_VALUE_PLANE_BITS = 2
"""Values are always stored as 2-bit planes (one for INT2, `hi` and `lo` for INT4)."""


# ----------------------------------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------------------------------


def _check_nbits(nbits: object) -> int:
    if isinstance(nbits, bool) or not isinstance(nbits, int):
        raise TypeError(f"`nbits` must be an int, one of {SUPPORTED_NBITS}, got {type(nbits).__name__} {nbits!r}")
    if nbits not in SUPPORTED_NBITS:
        raise ValueError(f"`nbits` must be one of {SUPPORTED_NBITS}, got {nbits}")
    return nbits


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value}")
    return value


def _check_kv(x: object, name: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor of shape [B, H, T, D], got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor (float32, float16 or bfloat16), got {x.dtype}")
    if x.ndim != 4:
        raise ValueError(f"`{name}` must have shape [B, H, T, D] (4 dims), got {x.ndim} dims: {tuple(x.shape)}")
    return x


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"`dtype` must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def _check_valid(valid: object, batch: int, tokens: int, device: torch.device) -> Tensor | None:
    if valid is None:
        return None
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool:
        got = valid.dtype if isinstance(valid, Tensor) else type(valid).__name__
        raise TypeError(f"`valid` must be a bool tensor of shape [B, T] (True = real token), got {got}")
    if tuple(valid.shape) != (batch, tokens):
        raise ValueError(f"`valid` must have shape [B, T] = {(batch, tokens)}, got {tuple(valid.shape)}")
    return valid.to(device)


def _check_codes_width(head_dim: int, bits_per_code: int, what: str) -> None:
    per_byte = 8 // bits_per_code
    if head_dim % per_byte:
        raise ValueError(
            f"{what}: `D` ({head_dim}) must be a multiple of {per_byte} to pack {bits_per_code}-bit codes into bytes"
        )


def _check_finite_params(scale: Tensor, zero: Tensor, name: str) -> None:
    # Groups with a non-finite element (or |x| > 65504) cannot be represented with fp16 metadata.
    if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(zero).all())):
        raise ValueError(
            f"`{name}` has non-finite values or values outside the float16 range (|x| <= 65504) in a group that "
            "is quantized; the fp16 scale/zero cannot represent it (mask padding tokens of keys with `valid`)"
        )


# ----------------------------------------------------------------------------------------------------------------------
# bit packing
# ----------------------------------------------------------------------------------------------------------------------


def pack_codes(codes: Tensor, nbits: int) -> Tensor:
    """Pack `nbits`-bit codes along the last dim into bytes, little end first.

    4-bit: element `2i` goes to the low nibble (bits 0-3) of byte `i`, element `2i+1` to the high nibble (bits 4-7).
    2-bit: element `4i + j` goes to bits `2j .. 2j+1` of byte `i` (j = 0..3).

    Args:
        codes (`torch.Tensor` of shape `[..., D]`, dtype `torch.uint8`): codes in `[0, 2**nbits - 1]`.
        nbits (`int`): 2 or 4.

    Returns:
        `torch.Tensor` of shape `[..., D * nbits // 8]`, dtype `torch.uint8`, contiguous.

    Raises:
        TypeError: `codes` is not a uint8 tensor.
        ValueError: `nbits` not in {2, 4}, `D` not a multiple of `8 // nbits`, or a code `>= 2**nbits`.
    """
    nbits = _check_nbits(nbits)
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, Tensor) else type(codes).__name__
        raise TypeError(f"`codes` must be a torch.uint8 tensor, got {got}")
    if codes.ndim < 1:
        raise ValueError("`codes` must have at least one dim (the packed channel dim is the last one)")
    per_byte = 8 // nbits
    width = codes.shape[-1]
    if width % per_byte:
        raise ValueError(f"the last dim of `codes` ({width}) must be a multiple of {per_byte} for nbits={nbits}")
    if codes.numel() and int(codes.max()) >= 2**nbits:
        raise ValueError(f"`codes` must lie in [0, {2**nbits - 1}] for nbits={nbits}, got max {int(codes.max())}")
    return _pack(codes, nbits)


def _pack(codes: Tensor, nbits: int) -> Tensor:
    """`pack_codes` without its checks (the quantizers' codes are clamped to the range already; no host read)."""
    per_byte = 8 // nbits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    packed = grouped[..., 0].clone()
    for j in range(1, per_byte):
        packed |= grouped[..., j] << (nbits * j)
    return packed.contiguous()


def unpack_codes(packed: Tensor, nbits: int, D: int) -> Tensor:
    """Inverse of `pack_codes`.

    Args:
        packed (`torch.Tensor` of shape `[..., D * nbits // 8]`, dtype `torch.uint8`): packed codes.
        nbits (`int`): 2 or 4.
        D (`int`): number of codes along the last dim (the head dim); must equal `packed.shape[-1] * 8 // nbits`.

    Returns:
        `torch.Tensor` of shape `[..., D]`, dtype `torch.uint8`, values in `[0, 2**nbits - 1]`.
    """
    nbits = _check_nbits(nbits)
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, Tensor) else type(packed).__name__
        raise TypeError(f"`packed` must be a torch.uint8 tensor, got {got}")
    if packed.ndim < 1:
        raise ValueError("`packed` must have at least one dim")
    per_byte = 8 // nbits
    if isinstance(D, bool) or not isinstance(D, int) or packed.shape[-1] * per_byte != D:
        raise ValueError(
            f"`D` must equal packed.shape[-1] * {per_byte} = {packed.shape[-1] * per_byte} for nbits={nbits}, got {D!r}"
        )
    mask = 2**nbits - 1
    parts = [(packed >> (nbits * j)) & mask for j in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], D)


# ----------------------------------------------------------------------------------------------------------------------
# the affine code (shared by keys and values)
# ----------------------------------------------------------------------------------------------------------------------


def _affine_params(mn: Tensor, mx: Tensor, nbits: int) -> tuple[Tensor, Tensor]:
    """fp32 `min`/`max` of each group -> fp16 `(scale, zero)`.

    `scale = fp16(fp32(mx - mn) / fp32(2**nbits - 1))` with IEEE division (the divisor is a tensor on the same device
    so that no backend turns it into a multiplication by a rounded reciprocal), `zero = fp16(mn)`; both casts round to
    nearest even; a zero result is stored as +0.0, never -0.0.
    """
    qmax = torch.tensor(float(2**nbits - 1), dtype=torch.float32, device=mn.device)
    scale = ((mx - mn) / qmax).to(torch.float16)
    zero = mn.to(torch.float16)
    # Canonicalise -0.0 to +0.0 so the stored bytes do not depend on how a backend's min/max breaks the tie between
    # -0.0 and +0.0 (or on a tiny negative minimum rounding to -0.0 in fp16). Numerically a no-op.
    positive_zero = torch.zeros((), dtype=torch.float16, device=mn.device)
    scale = torch.where(scale == 0, positive_zero, scale)
    zero = torch.where(zero == 0, positive_zero, zero)
    return scale, zero


def _encode(x32: Tensor, scale16: Tensor, zero16: Tensor, nbits: int) -> Tensor:
    """Codes of `x32` (fp32) given fp16 `scale16`/`zero16` broadcastable to it -> uint8 codes, same shape as `x32`.

    Exactly: `q = (x - fp32(zero16)) / fp32(scale16)` (two IEEE fp32 ops), `q = 0` where `scale16 == 0`,
    `q = round_half_even(q)`, NaN -> 0, `q = clamp(q, 0, 2**nbits - 1)`, cast to uint8.
    """
    qmax = float(2**nbits - 1)
    scale = scale16.to(torch.float32)
    q = (x32 - zero16.to(torch.float32)) / scale
    q = torch.where(scale == 0, torch.zeros((), dtype=q.dtype, device=q.device), q)
    q = torch.round(q)  # round half to even (IEEE rint), not half away from zero
    q = torch.nan_to_num(q, nan=0.0, posinf=qmax, neginf=0.0)  # only padding tokens can be non-finite
    return q.clamp(0.0, qmax).to(torch.uint8)


def _decode(codes: Tensor, scale16: Tensor, zero16: Tensor) -> Tensor:
    """`codes * scale + zero` in fp32 (a multiply, then an add; two roundings). `codes` may be fractional (cold)."""
    return codes.to(torch.float32) * scale16.to(torch.float32) + zero16.to(torch.float32)


# ----------------------------------------------------------------------------------------------------------------------
# containers
# ----------------------------------------------------------------------------------------------------------------------


def _tensor_nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _as_index(idx: Tensor | Sequence[int], device: torch.device) -> Tensor:
    index = torch.as_tensor(idx, dtype=torch.long, device=device)
    if index.ndim != 1:
        raise ValueError(f"`idx` must be a 1-D sequence of batch indices, got shape {tuple(index.shape)}")
    return index


def _check_range(start: int, end: int, size: int, what: str) -> None:
    for name, v in (("start", start), ("end", end)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"`{name}` must be an int, got {type(v).__name__}")
    if not 0 <= start <= end <= size:
        raise ValueError(f"need 0 <= `start` <= `end` <= {size} ({what}), got start={start}, end={end}")


@dataclass(frozen=True, eq=False)
class QuantizedKeys:
    """KIVI keys of one cache cell: per-channel codes over pages of `group_size` tokens.

    Attributes:
        codes (`torch.Tensor` of shape `[B, H, T, D * nbits // 8]`, dtype `torch.uint8`): packed codes along the
            channel dim (`pack_codes`): 4-bit -> `[B, H, T, D // 2]`, 2-bit -> `[B, H, T, D // 4]`.
        scale (`torch.Tensor` of shape `[B, H, T // group_size, D]`, dtype `torch.float16`): one scale per page and
            channel.
        zero (`torch.Tensor` of shape `[B, H, T // group_size, D]`, dtype `torch.float16`): one zero point (the page
            minimum) per page and channel.
        nbits (`int`): 2 or 4.
        group_size (`int`): tokens per page.

    Pages are independent, so a cache appends pages one at a time (quantizing pages apart equals quantizing them
    together), reads a page range with
    `select_pages` and reorders beams with `index_select_batch`. Instances are immutable containers; the methods
    return new ones (slices are views of the same storage).
    """

    codes: Tensor
    scale: Tensor
    zero: Tensor
    nbits: int
    group_size: int

    def __post_init__(self) -> None:
        _check_nbits(self.nbits)
        _check_positive_int(self.group_size, "group_size")
        if self.codes.dtype != torch.uint8 or self.codes.ndim != 4:
            raise ValueError(f"`codes` must be a 4-D uint8 tensor, got {self.codes.dtype} {tuple(self.codes.shape)}")
        b, h, t, _ = self.codes.shape
        if t % self.group_size:
            raise ValueError(f"`T` ({t}) of `codes` must be a multiple of `group_size` ({self.group_size})")
        expected = (b, h, t // self.group_size, self.head_dim)
        for name, tensor in (("scale", self.scale), ("zero", self.zero)):
            if tensor.dtype != torch.float16 or tuple(tensor.shape) != expected:
                raise ValueError(
                    f"`{name}` must be float16 of shape {expected}, got {tensor.dtype} {tuple(tensor.shape)}"
                )

    @property
    def num_tokens(self) -> int:
        """Tokens stored (`T`)."""
        return self.codes.shape[2]

    @property
    def num_pages(self) -> int:
        """Pages stored (`T // group_size`)."""
        return self.scale.shape[2]

    @property
    def head_dim(self) -> int:
        """Channels per head (`D`)."""
        return self.codes.shape[3] * (8 // self.nbits)

    @property
    def nbytes(self) -> int:
        """Bytes of all stored tensors (codes, scale, zero)."""
        return _tensor_nbytes(self.codes, self.scale, self.zero)

    def select_pages(self, start: int, end: int) -> QuantizedKeys:
        """Pages `[start, end)`, i.e. tokens `[start * group_size, end * group_size)` (views, no copy)."""
        _check_range(start, end, self.num_pages, "pages")
        t0, t1 = start * self.group_size, end * self.group_size
        return QuantizedKeys(
            codes=self.codes[:, :, t0:t1],
            scale=self.scale[:, :, start:end],
            zero=self.zero[:, :, start:end],
            nbits=self.nbits,
            group_size=self.group_size,
        )

    def index_select_batch(self, idx: Tensor | Sequence[int]) -> QuantizedKeys:
        """Rows `idx` of the batch dim (beam reordering); `idx` is a 1-D index tensor or list of ints."""
        index = _as_index(idx, self.codes.device)
        return QuantizedKeys(
            codes=self.codes.index_select(0, index),
            scale=self.scale.index_select(0, index),
            zero=self.zero.index_select(0, index),
            nbits=self.nbits,
            group_size=self.group_size,
        )


@dataclass(frozen=True, eq=False)
class QuantizedValues:
    """KIVI values of one cache cell: per-token codes over groups of `group_size` channels, stored as 2-bit planes.

    Values are always stored as packed 2-bit planes of shape `[B, H, T, D // 4]`:

    - INT4 (`nbits=4`): `hi` holds `c // 4` and `lo` holds `c % 4` of the 4-bit code `c`, so `c = 4 * hi + lo`. A
      reader that treats a token as cold reads only `hi` (LoopKV §3.3, V precision).
    - INT2 (`nbits=2`): `hi` holds the 2-bit codes themselves and `lo` is `None`. `hi` is always "the plane that every
      reader reads".

    Attributes:
        hi (`torch.Tensor` of shape `[B, H, T, D // 4]`, dtype `torch.uint8`): high plane (INT4) or the codes (INT2).
        lo (`torch.Tensor` of shape `[B, H, T, D // 4]`, dtype `torch.uint8`, or `None`): low plane (INT4 only).
        scale (`torch.Tensor` of shape `[B, H, T, D // group_size]`, dtype `torch.float16`): one scale per token and
            channel group.
        zero (`torch.Tensor` of shape `[B, H, T, D // group_size]`, dtype `torch.float16`): one zero point (the group
            minimum) per token and channel group.
        nbits (`int`): 2 or 4.
        group_size (`int`): channels per group.
    """

    hi: Tensor
    lo: Tensor | None
    scale: Tensor
    zero: Tensor
    nbits: int
    group_size: int

    def __post_init__(self) -> None:
        _check_nbits(self.nbits)
        _check_positive_int(self.group_size, "group_size")
        if self.hi.dtype != torch.uint8 or self.hi.ndim != 4:
            raise ValueError(f"`hi` must be a 4-D uint8 tensor, got {self.hi.dtype} {tuple(self.hi.shape)}")
        if (self.nbits == 4) != (self.lo is not None):
            raise ValueError("`lo` must be a tensor for nbits=4 and None for nbits=2")
        if self.lo is not None and (self.lo.dtype != torch.uint8 or self.lo.shape != self.hi.shape):
            raise ValueError(f"`lo` must be uint8 of shape {tuple(self.hi.shape)}, got {tuple(self.lo.shape)}")
        b, h, t, _ = self.hi.shape
        if self.head_dim % self.group_size:
            raise ValueError(f"`D` ({self.head_dim}) must be a multiple of `group_size` ({self.group_size})")
        expected = (b, h, t, self.head_dim // self.group_size)
        for name, tensor in (("scale", self.scale), ("zero", self.zero)):
            if tensor.dtype != torch.float16 or tuple(tensor.shape) != expected:
                raise ValueError(
                    f"`{name}` must be float16 of shape {expected}, got {tensor.dtype} {tuple(tensor.shape)}"
                )

    @property
    def num_tokens(self) -> int:
        """Tokens stored (`T`)."""
        return self.hi.shape[2]

    @property
    def head_dim(self) -> int:
        """Channels per head (`D`)."""
        return self.hi.shape[3] * (8 // _VALUE_PLANE_BITS)

    @property
    def nbytes(self) -> int:
        """Bytes of all stored tensors (planes, scale, zero)."""
        return _tensor_nbytes(self.hi, self.lo, self.scale, self.zero)

    def codes(self) -> Tensor:
        """Unpacked full codes, `[B, H, T, D]` uint8: `4 * hi + lo` (INT4) or `hi` (INT2)."""
        hi = unpack_codes(self.hi, _VALUE_PLANE_BITS, self.head_dim)
        if self.lo is None:
            return hi
        return (hi << 2) | unpack_codes(self.lo, _VALUE_PLANE_BITS, self.head_dim)

    def select_tokens(self, start: int, end: int) -> QuantizedValues:
        """Tokens `[start, end)` (views, no copy)."""
        _check_range(start, end, self.num_tokens, "tokens")
        return QuantizedValues(
            hi=self.hi[:, :, start:end],
            lo=None if self.lo is None else self.lo[:, :, start:end],
            scale=self.scale[:, :, start:end],
            zero=self.zero[:, :, start:end],
            nbits=self.nbits,
            group_size=self.group_size,
        )

    def index_select_batch(self, idx: Tensor | Sequence[int]) -> QuantizedValues:
        """Rows `idx` of the batch dim (beam reordering); `idx` is a 1-D index tensor or list of ints."""
        index = _as_index(idx, self.hi.device)
        return QuantizedValues(
            hi=self.hi.index_select(0, index),
            lo=None if self.lo is None else self.lo.index_select(0, index),
            scale=self.scale.index_select(0, index),
            zero=self.zero.index_select(0, index),
            nbits=self.nbits,
            group_size=self.group_size,
        )


# ----------------------------------------------------------------------------------------------------------------------
# keys
# ----------------------------------------------------------------------------------------------------------------------


def quantize_keys(
    x: Tensor,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    valid: Tensor | None = None,
    check_finite: bool = True,
) -> QuantizedKeys:
    """Quantize keys per channel over pages of `group_size` consecutive tokens.

    For page `g` and channel `d` of every `(b, h)`: `mn`/`mx` = min/max over the page's valid tokens (fp32),
    `scale = fp16((mx - mn) / (2**nbits - 1))`, `zero = fp16(mn)`, and each token's code is
    `clamp(round((x - zero) / scale), 0, 2**nbits - 1)` in fp32 with the fp16 scale/zero (code 0 where `scale == 0`).

    Args:
        x (`torch.Tensor` of shape `[B, H, T, D]`): keys, any float dtype (converted exactly to fp32). `T` must be a
            multiple of `group_size` and `D` a multiple of `8 // nbits`. Valid tokens must be finite and within the
            fp16 range.
        nbits (`int`): 2 or 4.
        group_size (`int`, *optional*, defaults to 32): tokens per page.
        valid (`torch.Tensor` of shape `[B, T]`, dtype `torch.bool`, *optional*): `True` for real tokens. Padding
            tokens (`False`) are left out of every page's min/max; a page-channel group without a valid token gets
            `scale = zero = 0` (all its codes are 0). Padding tokens still get codes (clamped to the range; a NaN
            gives 0), so they may hold any value, `inf`/`NaN` included.

    Returns:
        `QuantizedKeys`: `codes` `[B, H, T, D * nbits // 8]` uint8, `scale`/`zero` `[B, H, T // group_size, D]` fp16.

    Raises:
        TypeError: `x` is not a floating-point tensor, `nbits`/`group_size` not ints, `valid` not a bool tensor.
        ValueError: `nbits` not in {2, 4}, `x` not 4-D, `T` not a multiple of `group_size`, `D` not packable,
            `valid` of the wrong shape, or a valid group with non-finite/out-of-fp16-range values (unless
            `check_finite=False`: the check reads a flag back from the device, which a captured decode step must not).
    """
    x = _check_kv(x)
    nbits = _check_nbits(nbits)
    group_size = _check_positive_int(group_size, "group_size")
    b, h, t, d = x.shape
    if t % group_size:
        raise ValueError(f"keys are quantized in pages: `T` ({t}) must be a multiple of `group_size` ({group_size})")
    _check_codes_width(d, nbits, "keys")
    mask = _check_valid(valid, b, t, x.device)

    pages = t // group_size
    x32 = x.to(torch.float32).reshape(b, h, pages, group_size, d)
    if mask is None:
        mn = x32.amin(dim=3)
        mx = x32.amax(dim=3)
    else:
        m = mask.reshape(b, 1, pages, group_size, 1)
        inf = torch.tensor(float("inf"), dtype=torch.float32, device=x.device)
        mn = torch.where(m, x32, inf).amin(dim=3)
        mx = torch.where(m, x32, -inf).amax(dim=3)
        any_valid = m.any(dim=3)  # [B, 1, G, 1]
        zero32 = torch.zeros((), dtype=torch.float32, device=x.device)
        mn = torch.where(any_valid, mn, zero32)
        mx = torch.where(any_valid, mx, zero32)
    scale, zero = _affine_params(mn, mx, nbits)  # [B, H, G, D]
    if check_finite:
        _check_finite_params(scale, zero, "x")
    codes = _encode(x32, scale.unsqueeze(3), zero.unsqueeze(3), nbits).reshape(b, h, t, d)
    return QuantizedKeys(codes=_pack(codes, nbits), scale=scale, zero=zero, nbits=nbits, group_size=group_size)


def dequantize_keys(qk: QuantizedKeys, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantize keys: `x_hat = code * scale + zero` in fp32, then cast to `dtype`.

    Args:
        qk (`QuantizedKeys`): quantized keys.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): output dtype.

    Returns:
        `torch.Tensor` of shape `[B, H, T, D]` and dtype `dtype`.
    """
    if not isinstance(qk, QuantizedKeys):
        raise TypeError(f"`qk` must be a QuantizedKeys, got {type(qk).__name__}")
    dtype = _check_dtype(dtype)
    b, h, t, _ = qk.codes.shape
    d, gs = qk.head_dim, qk.group_size
    codes = unpack_codes(qk.codes, qk.nbits, d).reshape(b, h, t // gs, gs, d)
    x = _decode(codes, qk.scale.unsqueeze(3), qk.zero.unsqueeze(3))
    return x.reshape(b, h, t, d).to(dtype)


def fake_quantize_keys(
    x: Tensor,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    valid: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """`dequantize_keys(quantize_keys(x, ...))` in `dtype` (defaults to `x.dtype`). Shape `[B, H, T, D]`."""
    x = _check_kv(x)
    qk = quantize_keys(x, nbits, group_size=group_size, valid=valid)
    return dequantize_keys(qk, dtype=x.dtype if dtype is None else dtype)


# ----------------------------------------------------------------------------------------------------------------------
# values
# ----------------------------------------------------------------------------------------------------------------------


def quantize_values(
    x: Tensor,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    valid: Tensor | None = None,
    check_finite: bool = True,
) -> QuantizedValues:
    """Quantize values per token over groups of `group_size` consecutive channels.

    For token `t` and channel group `g` of every `(b, h)`: `mn`/`mx` = min/max over the group's channels (fp32),
    `scale = fp16((mx - mn) / (2**nbits - 1))`, `zero = fp16(mn)`, codes as in `quantize_keys`. INT4 codes are stored
    as two 2-bit planes `hi = c // 4`, `lo = c % 4`; INT2 codes as one 2-bit plane (`hi`; `lo` is `None`).

    Args:
        x (`torch.Tensor` of shape `[B, H, T, D]`): values, any float dtype. `D` must be a multiple of `group_size`
            and of 4. Every token must be finite and within the fp16 range.
        nbits (`int`): 2 or 4.
        group_size (`int`, *optional*, defaults to 32): channels per group.
        valid (`torch.Tensor` of shape `[B, T]`, dtype `torch.bool`, *optional*): accepted for symmetry with
            `quantize_keys`, validated and otherwise **ignored**: values are grouped per token, so a padding token
            never influences a real token's scale or zero.

    Returns:
        `QuantizedValues`: `hi`/`lo` `[B, H, T, D // 4]` uint8, `scale`/`zero` `[B, H, T, D // group_size]` fp16.

    Raises:
        TypeError / ValueError: as `quantize_keys`, with `D` (not `T`) required to be a multiple of `group_size`.
    """
    x = _check_kv(x)
    nbits = _check_nbits(nbits)
    group_size = _check_positive_int(group_size, "group_size")
    b, h, t, d = x.shape
    if d % group_size:
        raise ValueError(
            f"values are quantized per channel group: `D` ({d}) must be a multiple of `group_size` ({group_size})"
        )
    _check_codes_width(d, _VALUE_PLANE_BITS, "values")
    _check_valid(valid, b, t, x.device)  # validated for symmetry, not used

    x32 = x.to(torch.float32).reshape(b, h, t, d // group_size, group_size)
    scale, zero = _affine_params(x32.amin(dim=4), x32.amax(dim=4), nbits)  # [B, H, T, D // gs]
    if check_finite:
        _check_finite_params(scale, zero, "x")
    codes = _encode(x32, scale.unsqueeze(4), zero.unsqueeze(4), nbits).reshape(b, h, t, d)
    if nbits == 4:
        hi = _pack(codes >> 2, _VALUE_PLANE_BITS)
        lo: Tensor | None = _pack(codes & 3, _VALUE_PLANE_BITS)
    else:
        hi, lo = _pack(codes, _VALUE_PLANE_BITS), None
    return QuantizedValues(hi=hi, lo=lo, scale=scale, zero=zero, nbits=nbits, group_size=group_size)


def _broadcast_hot(hot: object, b: int, h: int, t: int, device: torch.device) -> tuple[Tensor, bool]:
    """Validate `hot`; return it broadcast to `[B, H, T]` or `[B, H, Q, T]` and whether it is per query."""
    if not isinstance(hot, Tensor) or hot.dtype != torch.bool:
        got = hot.dtype if isinstance(hot, Tensor) else type(hot).__name__
        raise TypeError(f"`hot` must be a bool tensor broadcastable to [B, H, T] or [B, H, Q, T], got {got}")
    if hot.ndim > 4:
        raise ValueError(f"`hot` must have at most 4 dims ([B, H, Q, T]), got shape {tuple(hot.shape)}")
    per_query = hot.ndim == 4
    target = (b, h, hot.shape[2], t) if per_query else (b, h, t)
    try:
        out = hot.to(device).expand(target)
    except RuntimeError:
        want = "[B, H, Q, T]" if per_query else "[B, H, T]"
        raise ValueError(f"`hot` of shape {tuple(hot.shape)} does not broadcast to {want} = {target}") from None
    return out, per_query


def dequantize_values(qv: QuantizedValues, *, dtype: torch.dtype = torch.float32, hot: Tensor | None = None) -> Tensor:
    """Dequantize values, optionally with LoopKV's read-time V precision.

    Every token decodes as `x_hat = c_hat * scale + zero` in fp32 (multiply, then add), cast to `dtype`, with

    - `c_hat = 4 * hi + lo` (the full INT4 code) for INT4 tokens that are hot, and for all tokens when `hot is None`;
    - `c_hat = 4 * hi + 1.5` (the midpoint of the `hi` bucket; only the `hi` plane is read) for INT4 tokens that are
      cold (`hot` False). Then `|c - c_hat| <= 1.5`, see `cold_value_error_bound`;
    - `c_hat = hi` for INT2: there is no `lo` plane, so `hot` does not change any value (it still sets the output
      shape, so a caller can treat INT2 and INT4 cells alike).

    Args:
        qv (`QuantizedValues`): quantized values.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): output dtype.
        hot (`torch.Tensor`, dtype `torch.bool`, *optional*): which tokens read both planes. Its number of dims
            selects the mode:

            - at most 3 dims: one decision per token, broadcast (right-aligned, the usual rules) to `[B, H, T]`;
              the output is `[B, H, T, D]`.
            - 4 dims: one decision per query row, broadcast to `[B, H, Q, T]` (`Q = hot.shape[2]`); the output is
              `[B, H, Q, T, D]`, row `q` being the values as query `q` reads them. This is what a per-query
              attention reference needs (`einsum("bhqt,bhqtd->bhqd", probs, v)`); it costs `Q` times the memory.

    Returns:
        `torch.Tensor` of shape `[B, H, T, D]` (or `[B, H, Q, T, D]` for a 4-D `hot`) and dtype `dtype`.
    """
    if not isinstance(qv, QuantizedValues):
        raise TypeError(f"`qv` must be a QuantizedValues, got {type(qv).__name__}")
    dtype = _check_dtype(dtype)
    b, h, t, _ = qv.hi.shape
    d, gs = qv.head_dim, qv.group_size
    hi = unpack_codes(qv.hi, _VALUE_PLANE_BITS, d).to(torch.float32)
    four = torch.tensor(4.0, dtype=torch.float32, device=hi.device)
    if qv.lo is None:
        full = hi
    else:
        full = hi * four + unpack_codes(qv.lo, _VALUE_PLANE_BITS, d).to(torch.float32)  # exact small integers
    scale, zero = qv.scale.unsqueeze(-1), qv.zero.unsqueeze(-1)  # [B, H, T, D // gs, 1]

    lead: tuple[int, ...]
    if hot is None:
        codes, lead = full, (b, h, t)
    else:
        mask, per_query = _broadcast_hot(hot, b, h, t, hi.device)
        if qv.lo is None:
            codes = full
        else:
            cold = hi * four + _COLD_CODE_OFFSET  # exact: multiples of 4 plus 1.5
            if per_query:
                codes = torch.where(mask.unsqueeze(-1), full.unsqueeze(2), cold.unsqueeze(2))
            else:
                codes = torch.where(mask.unsqueeze(-1), full, cold)
        if per_query:
            q = mask.shape[2]
            if codes.ndim == 4:  # INT2: same codes for every query row
                codes = codes.unsqueeze(2).expand(b, h, q, t, d)
            scale, zero = scale.unsqueeze(2), zero.unsqueeze(2)
            lead = (b, h, q, t)
        else:
            lead = (b, h, t)
    x = _decode(codes.reshape(*lead, d // gs, gs), scale, zero)
    return x.reshape(*lead, d).to(dtype)


def fake_quantize_values(
    x: Tensor,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    valid: Tensor | None = None,
    dtype: torch.dtype | None = None,
    hot: Tensor | None = None,
) -> Tensor:
    """`dequantize_values(quantize_values(x, ...), hot=hot)` in `dtype` (defaults to `x.dtype`).

    Shape `[B, H, T, D]`, or `[B, H, Q, T, D]` for a 4-D `hot` (see `dequantize_values`).
    """
    x = _check_kv(x)
    qv = quantize_values(x, nbits, group_size=group_size, valid=valid)
    return dequantize_values(qv, dtype=x.dtype if dtype is None else dtype, hot=hot)


def cold_value_error_bound(qv: QuantizedValues) -> Tensor:
    """Per-token value error of a cold read, relative to the full INT4 read (LoopKV Proposition 1).

    A cold INT4 token decodes `c_hat = 4 * hi + 1.5` instead of `c = 4 * hi + lo`; since `lo` is in `{0, 1, 2, 3}`,
    `|c - c_hat| <= 1.5` and so `|v_full - v_cold| <= 1.5 * scale` for every channel of the group (exact arithmetic;
    the fp32 evaluation of both decodes adds at most a few ulp of `|v|`). Relative to the *original* value the cold
    error is at most `1.5 * scale` plus the quantization error of the full code (`scale / 2` plus fp16 rounding of
    scale/zero). INT2 values have no `lo` plane: every read is full, so the bound is 0.

    Args:
        qv (`QuantizedValues`): quantized values.

    Returns:
        `torch.Tensor` of shape `[B, H, T, D // group_size]`, dtype `torch.float32`: `1.5 * scale` (INT4) or zeros
        (INT2); expand over a group's channels with `.repeat_interleave(group_size, dim=-1)`.
    """
    if not isinstance(qv, QuantizedValues):
        raise TypeError(f"`qv` must be a QuantizedValues, got {type(qv).__name__}")
    scale = qv.scale.to(torch.float32)
    if qv.nbits == 2:
        return torch.zeros_like(scale)
    return scale * _COLD_CODE_OFFSET


# ----------------------------------------------------------------------------------------------------------------------
# byte model
# ----------------------------------------------------------------------------------------------------------------------
# the flush of a static cell: one page from a ring into page storage
# ----------------------------------------------------------------------------------------------------------------------


def _check_index_tensor(t: object, name: str, dtype_kind: str, numel: int, device: torch.device) -> Tensor:
    ok = isinstance(t, Tensor) and t.numel() == numel and t.ndim <= 1
    if ok and dtype_kind == "bool":
        ok = t.dtype == torch.bool  # type: ignore[union-attr]
    elif ok:
        ok = t.dtype in (torch.int64, torch.int32)  # type: ignore[union-attr]
    if not ok:
        what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        want = "bool" if dtype_kind == "bool" else "int64 / int32"
        shape = "[] or [1]" if numel == 1 else f"[{numel}]"
        raise TypeError(f"`{name}` must be a {want} tensor of {numel} element(s) (shape {shape}), got {what}")
    if t.device != device:  # type: ignore[union-attr]
        raise ValueError(f"`{name}` is on {t.device} but `ring_key` is on {device}; a kernel reads one device")  # type: ignore[union-attr]
    return t  # type: ignore[return-value]


def _check_flush(
    ring_key: object,
    ring_value: object,
    keys: object,
    values: object,
    slots: object,
    page: object,
    due: object,
    start: object,
    floor: object,
    scratch_page: object,
    valid: object,
    coded: object = None,
) -> None:
    """Validation of `flush_page` (shapes and dtypes only: nothing is read back from the device)."""
    ring_key, ring_value = _check_kv(ring_key, "ring_key"), _check_kv(ring_value, "ring_value")
    if ring_key.shape != ring_value.shape:
        raise ValueError(
            f"`ring_key` and `ring_value` must have the same shape [B, H, C, D], got {tuple(ring_key.shape)} and "
            f"{tuple(ring_value.shape)}"
        )
    if not isinstance(keys, QuantizedKeys) or not isinstance(values, QuantizedValues):
        raise TypeError(
            f"`keys` / `values` must be QuantizedKeys / QuantizedValues (the page storage), got "
            f"{type(keys).__name__} / {type(values).__name__}"
        )
    if keys.nbits != values.nbits:
        raise ValueError(f"`keys.nbits` ({keys.nbits}) and `values.nbits` ({values.nbits}) must be equal")
    if not isinstance(slots, Tensor) or slots.ndim != 1 or slots.dtype not in (torch.int64, torch.int32):
        got = f"{slots.dtype} {tuple(slots.shape)}" if isinstance(slots, Tensor) else type(slots).__name__
        raise TypeError(f"`slots` must be a 1-D int64 / int32 tensor of the pages' ring slots [K * P], got {got}")
    if not isinstance(page, Tensor) or page.numel() < 1:
        raise TypeError(f"`page` must be a non-empty int64 tensor of the K destination pages, got {page!r}")
    p, n_pages = keys.group_size, page.numel()
    if slots.shape[0] != n_pages * p:
        raise ValueError(
            f"`slots` holds {slots.shape[0]} positions but {n_pages} page(s) of `keys.group_size` = {p} need "
            f"{n_pages * p}"
        )
    if isinstance(scratch_page, bool) or not isinstance(scratch_page, int) or scratch_page < 0:
        raise TypeError(f"`scratch_page` must be a non-negative int (the page written when none is due), got {scratch_page!r}")
    b, h, _, d = ring_key.shape
    pages = scratch_page + 1
    want = {
        "keys.codes": (keys.codes, (h, pages * p, d * keys.nbits // 8)),
        "keys.scale": (keys.scale, (h, pages, d)),
        "keys.zero": (keys.zero, (h, pages, d)),
        "values.hi": (values.hi, (h, pages * p, d // 4)),
        "values.scale": (values.scale, (h, pages * p, d // values.group_size)),
        "values.zero": (values.zero, (h, pages * p, d // values.group_size)),
    }
    if values.lo is not None:
        want["values.lo"] = (values.lo, (h, pages * p, d // 4))
    for name, (t, (heads, rows, width)) in want.items():
        s = tuple(t.shape)
        if t.ndim != 4 or s[0] < b or s[1] != heads or s[2] < rows or s[3] != width:
            raise ValueError(
                f"`{name}` must hold at least {b} rows, {heads} heads, {rows} token (or page) rows up to the scratch "
                f"page {scratch_page}, and {width} columns for `ring_key` of shape {tuple(ring_key.shape)}; got {s}"
            )
        if t.device != ring_key.device:
            raise ValueError(f"`{name}` is on {t.device} but `ring_key` is on {ring_key.device}; a kernel reads one device")
    if d % values.group_size:
        raise ValueError(f"`D` ({d}) must be a multiple of `values.group_size` ({values.group_size})")
    _check_codes_width(d, _VALUE_PLANE_BITS, "values")
    _check_codes_width(d, keys.nbits, "keys")
    if slots.device != ring_key.device:
        raise ValueError(f"`slots` is on {slots.device} but `ring_key` is on {ring_key.device}; a kernel reads one device")
    for name, t, kind, n in (("page", page, "int", n_pages), ("due", due, "bool", n_pages),
                             ("start", start, "int", n_pages), ("floor", floor, "int", 1)):  # fmt: skip
        _check_index_tensor(t, name, kind, n, ring_key.device)
    if valid is not None:
        if not isinstance(valid, Tensor) or valid.dtype != torch.bool:
            got = valid.dtype if isinstance(valid, Tensor) else type(valid).__name__
            raise TypeError(f"`valid` must be a bool tensor of shape [B, P] (True = real token), got {got}")
        if tuple(valid.shape) != (b, n_pages * p):
            raise ValueError(f"`valid` must have shape [B, K * P] = {(b, n_pages * p)}, got {tuple(valid.shape)}")
        if valid.device != ring_key.device:
            raise ValueError(f"`valid` is on {valid.device} but `ring_key` is on {ring_key.device}; a kernel reads one device")
    if coded is not None:
        if not isinstance(coded, Tensor) or coded.dtype != torch.int32:
            got = coded.dtype if isinstance(coded, Tensor) else type(coded).__name__
            raise TypeError(f"`coded` must be an int32 tensor [B', H, 2, K] of the pages last coded, got {got}")
        s = tuple(coded.shape)
        if coded.ndim != 4 or s[0] < b or s[1:] != (h, 2, n_pages) or not coded.is_contiguous():
            raise ValueError(
                f"`coded` must be a contiguous [B', H, 2, K] tensor with B' >= {b}, H = {h}, K = {n_pages}, got {s}"
            )
        if coded.device != ring_key.device:
            raise ValueError(f"`coded` is on {coded.device} but `ring_key` is on {ring_key.device}; a kernel reads one device")


def flush_page(
    ring_key: Tensor,
    ring_value: Tensor,
    keys: QuantizedKeys,
    values: QuantizedValues,
    *,
    slots: Tensor,
    page: Tensor,
    due: Tensor,
    start: Tensor,
    floor: Tensor,
    scratch_page: int,
    valid: Tensor | None = None,
    coded: Tensor | None = None,
) -> None:
    """Code `K` pages of positions held in a ring and write them into page storage, in place: the flush of a static
    coded cell's forward (`hf_loopcache` `StaticCodedLayer.flush`). Reference of `triton_ops.quant.flush_page`.

    Gathers ring slots `slots` of `ring_key` / `ring_value`, quantizes them as `quantize_keys` (pages of
    `keys.group_size` positions, `valid` leaving padding out of the min/max) and `quantize_values` do, and writes
    page `k`'s codes, scales and zero points to page `page[k]` of `keys` / `values` when `due[k] and start[k] >=
    floor`, else to page `scratch_page` (which nobody reads; several pages sent there land in an unspecified order):
    every call writes the same number of bytes and nothing is read back on the host.

    Args:
        ring_key, ring_value (`torch.Tensor` of shape `[B, H, C, D]`): the ring (any float dtype, any strides).
        keys (`QuantizedKeys`): page storage, `codes` `[B', H, N * P, D * nbits // 8]`, `scale` / `zero`
            `[B', H, N, D]` with `B' >= B`, `N > scratch_page`, `P = keys.group_size`; rows `[0, B)` are written.
        values (`QuantizedValues`): page storage, `hi` (/ `lo`) `[B', H, N * P, D // 4]`, `scale` / `zero`
            `[B', H, N * P, D // values.group_size]`; same `nbits` as `keys`.
        slots (`torch.LongTensor` of shape `[K * P]`): ring slots of the pages' positions, page by page, in position
            order.
        page (`torch.LongTensor` of shape `[K]`, or `[]` for one page): the destination pages when due.
        due (`torch.BoolTensor` of shape `[K]`): whether each page is due.
        start (`torch.LongTensor` of shape `[K]`), floor (`torch.LongTensor`, one element): each page's first position
            and the lowest position the ring still holds; a page is written only when `start >= floor`.
        scratch_page (`int`): the page written instead (a page past the readable ones).
        valid (`torch.BoolTensor` of shape `[B, K * P]`, *optional*): key validity of the pages' positions.
        coded (`torch.IntTensor` of shape `[B', H, 2, K]`, *optional*): per row, head and plane (keys, values), the
            page last coded in each of `K` slots (page `n` in slot `n % K`; -1: none). A page written when due is
            written only where its slot does not already hold it (it was coded before, from the same positions and
            validity), and the slot then holds it: a forward in which no page became due writes nothing. The caller
            clears the slots of pages whose positions change (a crop into them, a reset). Without it every due page
            is written.
    """
    _check_flush(ring_key, ring_value, keys, values, slots, page, due, start, floor, scratch_page, valid, coded)
    _flush_page(ring_key, ring_value, keys, values, slots, page, due, start, floor, scratch_page, valid, coded)


def _flush_page(ring_key, ring_value, keys, values, slots, page, due, start, floor, scratch_page, valid, coded=None):
    """`flush_page` without validation: gather, quantize (no finite check: no host read), pick the pages, write."""
    b, p = ring_key.shape[0], keys.group_size
    k, v = ring_key.index_select(2, slots), ring_value.index_select(2, slots)
    qk = quantize_keys(k, keys.nbits, group_size=p, valid=valid, check_finite=False)
    qv = quantize_values(v, values.nbits, group_size=values.group_size, check_finite=False)
    write = (due & (start >= floor)).reshape(-1)  # [K]
    page = page.reshape(-1)
    dst = torch.where(write, page, scratch_page)  # [K]
    tokens = (dst[:, None] * p + torch.arange(p, device=dst.device)).flatten()  # [K * P]
    pairs = [(keys.codes, qk.codes, 0, True), (keys.scale, qk.scale, 0, False), (keys.zero, qk.zero, 0, False),
             (values.hi, qv.hi, 1, True), (values.scale, qv.scale, 1, True), (values.zero, qv.zero, 1, True)]  # fmt: skip
    if qv.lo is not None and values.lo is not None:
        pairs.append((values.lo, qv.lo, 1, True))
    if coded is None:
        for dst_t, src, _, per_token in pairs:
            dst_t[:b].index_copy_(2, tokens if per_token else dst, src)
        return
    n = page.numel()
    slot = page % n  # [K]
    state = coded[:b]  # [B, H, 2, K]
    held = state.index_select(3, slot)  # [B, H, 2, K]: what each page's slot holds
    fresh = write & (held != page)  # [B, H, 2, K]: the pages each (row, head, plane) codes now
    for dst_t, src, plane, per_token in pairs:
        index = tokens if per_token else dst
        m = fresh[:, :, plane]  # [B, H, K]
        m = (m.repeat_interleave(p, dim=2) if per_token else m)[..., None]
        dst_t[:b].index_copy_(2, index, torch.where(m, src, dst_t[:b].index_select(2, index)))
    for i in range(n):  # page by page: a page that is not written may share a written page's slot
        cur = state.index_select(3, slot[i : i + 1])
        state.index_copy_(3, slot[i : i + 1], torch.where(fresh[..., i : i + 1], page[i : i + 1].to(state.dtype), cur))


# ----------------------------------------------------------------------------------------------------------------------


def kivi_bytes_per_token(
    num_kv_heads: int,
    head_dim: int,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    page_size: int | None = None,
) -> float:
    """Stored bytes of keys + values for ONE token of one layer (one cell), metadata included (LoopKV Appendix C).

    Per token and head: key codes `D * nbits / 8` + value codes `D * nbits / 8` (INT4 values: two 2-bit planes, same
    bytes) + key metadata `2 * D * 2 / page_size` (fp16 scale and zero per channel, shared by the `page_size` tokens
    of a page) + value metadata `2 * (D / group_size) * 2` (fp16 scale and zero per channel group). With
    `group_size = page_size = 32` that is `nbits + 1` bits per element: at 16 heads x 128, INT4 = 2560 B (2.5 KiB) and
    INT2 = 1536 B (1.5 KiB). Equals `(qk.nbytes + qv.nbytes) / (B * T)` of actual quantized tensors. This is the one
    statement of the coded byte model: `hf_loopcache`'s plans and planner use it.

    Args:
        num_kv_heads (`int`): key/value heads per layer.
        head_dim (`int`): channels per head; a multiple of `group_size` and of 4 (what `quantize_values` requires).
        nbits (`int`): 2 or 4.
        group_size (`int`, *optional*, defaults to 32): channels per value group (and tokens per key page unless
            `page_size` is given).
        page_size (`int`, *optional*): tokens per key page; defaults to `group_size`.

    Returns:
        `float`: bytes per token and layer.
    """
    num_kv_heads = _check_positive_int(num_kv_heads, "num_kv_heads")
    head_dim = _check_positive_int(head_dim, "head_dim")
    nbits = _check_nbits(nbits)
    group_size = _check_positive_int(group_size, "group_size")
    page_size = group_size if page_size is None else _check_positive_int(page_size, "page_size")
    if head_dim % group_size:
        raise ValueError(f"`head_dim` ({head_dim}) must be a multiple of `group_size` ({group_size})")
    _check_codes_width(head_dim, _VALUE_PLANE_BITS, "values")
    fp16_bytes = torch.finfo(torch.float16).bits // 8
    elements = num_kv_heads * head_dim
    code_bytes = 2 * elements * nbits / 8  # keys + values
    key_meta = elements * 2 * fp16_bytes / page_size  # scale + zero per channel per page, amortised per token
    value_meta = (elements // group_size) * 2 * fp16_bytes  # scale + zero per channel group of every token
    return float(code_bytes + key_meta + value_meta)
