"""Host side of the KIVI quantize kernels: launchers and the public `quantize_keys` / `quantize_values` /
`flush_page` that dispatch to Triton on CUDA tensors and to the pure-torch reference (`naive.py`) everywhere else.

Both paths produce the same bytes (codes, fp16 scales and zero points); `tests/ops/test_quant_kernels.py` checks
it against `naive.py` under `TRITON_INTERPRET=1` on CPU and on the GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from triton_ops._dispatch import launch_device, next_pow2, pdl_options, use_triton
from triton_ops.quant import naive
from triton_ops.quant.naive import (
    DEFAULT_GROUP_SIZE,
    QuantizedKeys,
    QuantizedValues,
    _check_codes_width,
    _check_finite_params,
    _check_flush,
    _check_kv,
    _check_nbits,
    _check_positive_int,
    _check_valid,
)

__all__ = ["FlushTable", "flush_page", "flush_page_table", "quantize_keys", "quantize_values"]


def _quantize_keys_fwd(x: Tensor, nbits: int, group_size: int, valid: Tensor | None) -> QuantizedKeys:
    """Launch `_quantize_keys_fwd_kernel` on `x` `[B, H, T, D]` (any strides); returns contiguous outputs."""
    from triton_ops.quant.kernels import _quantize_keys_fwd_kernel

    b, h, t, d = x.shape
    per_byte = 8 // nbits
    codes = torch.empty(b, h, t, d // per_byte, dtype=torch.uint8, device=x.device)
    scale = torch.empty(b, h, t // group_size, d, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    if x.numel():
        valid_arg = valid if valid is not None else codes  # any pointer; unused without USE_VALID
        _quantize_keys_fwd_kernel[(t // group_size, b * h)](
            x_ptr=x,
            valid_ptr=valid_arg,
            codes_ptr=codes,
            scale_ptr=scale,
            zero_ptr=zero,
            H=h,
            T=t,
            stride_xb=x.stride(0),
            stride_xh=x.stride(1),
            stride_xt=x.stride(2),
            stride_xd=x.stride(3),
            stride_vb=valid.stride(0) if valid is not None else 0,
            stride_vt=valid.stride(1) if valid is not None else 0,
            stride_cb=codes.stride(0),
            stride_ch=codes.stride(1),
            stride_ct=codes.stride(2),
            stride_sb=scale.stride(0),
            stride_sh=scale.stride(1),
            stride_sg=scale.stride(2),
            D=d,
            NBITS=nbits,
            GROUP=group_size,
            BLOCK_G=next_pow2(group_size),
            BLOCK_C=next_pow2(d // per_byte),
            USE_VALID=valid is not None,
        )
    return QuantizedKeys(codes=codes, scale=scale, zero=zero, nbits=nbits, group_size=group_size)


def _quantize_values_fwd(x: Tensor, nbits: int, group_size: int) -> QuantizedValues:
    """Launch `_quantize_values_fwd_kernel` on `x` `[B, H, T, D]` (any strides); returns contiguous outputs."""
    from triton_ops.quant.kernels import _quantize_values_fwd_kernel

    b, h, t, d = x.shape
    hi = torch.empty(b, h, t, d // 4, dtype=torch.uint8, device=x.device)
    lo = torch.empty_like(hi) if nbits == 4 else None
    scale = torch.empty(b, h, t, d // group_size, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    block_t = 16
    if x.numel():
        _quantize_values_fwd_kernel[(_cdiv(t, block_t), b * h)](
            x_ptr=x,
            hi_ptr=hi,
            lo_ptr=lo if lo is not None else hi,
            scale_ptr=scale,
            zero_ptr=zero,
            H=h,
            T=t,
            stride_xb=x.stride(0),
            stride_xh=x.stride(1),
            stride_xt=x.stride(2),
            stride_xd=x.stride(3),
            stride_cb=hi.stride(0),
            stride_ch=hi.stride(1),
            stride_ct=hi.stride(2),
            stride_sb=scale.stride(0),
            stride_sh=scale.stride(1),
            stride_st=scale.stride(2),
            D=d,
            NBITS=nbits,
            GROUP=group_size,
            BLOCK_T=block_t,
            BLOCK_NG=next_pow2(d // group_size),
            BLOCK_K=next_pow2(group_size // 4),
        )
    return QuantizedValues(hi=hi, lo=lo, scale=scale, zero=zero, nbits=nbits, group_size=group_size)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_keys(
    x: Tensor,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    valid: Tensor | None = None,
    check_finite: bool = True,
) -> QuantizedKeys:
    """Quantize keys per channel over pages of `group_size` tokens; same contract and bytes as
    `triton_ops.quant.naive.quantize_keys` (see there and README.md for the math).

    Runs the Triton kernel when `x` is on a CUDA device and Triton is installed (one launch, no copy of `x`: any
    strides), the reference otherwise.

    Args:
        x (`torch.Tensor` of shape `[B, H, T, D]`): keys, fp32 / fp16 / bf16; `T % group_size == 0`,
            `D % (8 // nbits) == 0`.
        nbits (`int`): 2 or 4.
        group_size (`int`, *optional*, defaults to 32): tokens per page.
        valid (`torch.BoolTensor` of shape `[B, T]`, *optional*): False marks padding tokens, which take no part in
            the page minima and maxima.
        check_finite (`bool`, *optional*, defaults to True): raise `ValueError` when a group's scale or zero point is
            not finite (an input outside the fp16 range). The check reads one flag back from the device (a sync);
            a caller that guarantees finite inputs on a hot path may switch it off (both paths).

    Returns:
        `QuantizedKeys` with contiguous `codes` `[B, H, T, D * nbits // 8]` and fp16 `scale` / `zero`
        `[B, H, T // group_size, D]`.

    Example:
        >>> x = torch.randn(1, 2, 64, 128)
        >>> quantize_keys(x, 4).codes.shape
        torch.Size([1, 2, 64, 64])
    """
    x = _check_kv(x)
    nbits = _check_nbits(nbits)
    group_size = _check_positive_int(group_size, "group_size")
    if not use_triton("quantize_keys", x):
        return naive.quantize_keys(x, nbits, group_size=group_size, valid=valid, check_finite=check_finite)
    b, _, t, d = x.shape
    if t % group_size:
        raise ValueError(f"keys are quantized per page: `T` ({t}) must be a multiple of `group_size` ({group_size})")
    _check_codes_width(d, nbits, "keys")
    valid = _check_valid(valid, b, t, x.device)
    with launch_device(x):  # the tensor's GPU, not the current one (multi-GPU `device_map`)
        qk = _quantize_keys_fwd(x, nbits, group_size, valid)
    if check_finite:
        _check_finite_params(qk.scale, qk.zero, "x")
    return qk


def quantize_values(
    x: Tensor,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    valid: Tensor | None = None,
    check_finite: bool = True,
) -> QuantizedValues:
    """Quantize values per token over groups of `group_size` channels; same contract and bytes as
    `triton_ops.quant.naive.quantize_values` (INT4 as two 2-bit planes `hi`, `lo`; INT2 as `hi` only).

    Runs the Triton kernel when `x` is on a CUDA device and Triton is installed, the reference otherwise.

    Args:
        x (`torch.Tensor` of shape `[B, H, T, D]`): values; `D % group_size == 0` and `D % 4 == 0`.
        nbits (`int`): 2 or 4.
        group_size (`int`, *optional*, defaults to 32): channels per group.
        valid (`torch.BoolTensor` of shape `[B, T]`, *optional*): validated and ignored (values are per token).
        check_finite (`bool`, *optional*, defaults to True): as in `quantize_keys`.

    Returns:
        `QuantizedValues`: `hi` / `lo` `[B, H, T, D // 4]` uint8, `scale` / `zero` `[B, H, T, D // group_size]` fp16.
    """
    x = _check_kv(x)
    nbits = _check_nbits(nbits)
    group_size = _check_positive_int(group_size, "group_size")
    if not use_triton("quantize_values", x):
        return naive.quantize_values(x, nbits, group_size=group_size, valid=valid, check_finite=check_finite)
    b, _, t, d = x.shape
    if d % group_size:
        raise ValueError(
            f"values are quantized per channel group: `D` ({d}) must be a multiple of `group_size` ({group_size})"
        )
    _check_codes_width(d, 2, "values")
    _check_valid(valid, b, t, x.device)
    with launch_device(x):  # the tensor's GPU, not the current one (multi-GPU `device_map`)
        qv = _quantize_values_fwd(x, nbits, group_size)
    if check_finite:
        _check_finite_params(qv.scale, qv.zero, "x")
    return qv


def _flush_page_fwd(
    ring_key: Tensor,
    ring_value: Tensor,
    keys: QuantizedKeys,
    values: QuantizedValues,
    slots: Tensor,
    page: Tensor,
    due: Tensor,
    start: Tensor,
    floor: Tensor,
    scratch_page: int,
    valid: Tensor | None,
    coded: Tensor | None = None,
    table: Tensor | None = None,
) -> None:
    """Launch `_flush_page_fwd_kernel`: one launch, grid `(B * H, 2, K)` (keys / values of each of the K pages),
    writing rows `[0, B)` of the page storage in place; the programs of a page that is not due (or no longer held)
    exit at once and write nothing (`scratch_page` is the reference's; the kernel leaves it alone), and so do those of
    a page whose `coded` slot already holds it. The ring may have any strides; the storage needs unit stride on its
    last dim, and `hi` /
    `lo`, the two key metadata tensors and the two value metadata tensors must share their strides."""
    from triton_ops.quant.kernels import _flush_page_fwd_kernel

    pairs = [("keys.scale", keys.scale, "keys.zero", keys.zero), ("values.scale", values.scale, "values.zero", values.zero)]
    if values.lo is not None:
        pairs.append(("values.hi", values.hi, "values.lo", values.lo))
    for a, ta, b_, tb in pairs:
        if ta.stride() != tb.stride():
            raise ValueError(f"`{a}` and `{b_}` must have the same strides, got {ta.stride()} and {tb.stride()}")
    for name, t in (("keys.codes", keys.codes), ("keys.scale", keys.scale), ("values.hi", values.hi),
                    ("values.scale", values.scale)):  # fmt: skip
        if t.stride(-1) != 1:
            raise ValueError(f"`{name}` must have unit stride on its last dim, got strides {t.stride()}")
    b, h, _, d = ring_key.shape
    p, gs = keys.group_size, values.group_size
    pages = page.numel()
    if not b * h:
        return
    page, due, start = page.reshape(-1), due.reshape(-1), start.reshape(-1)  # views: [K], contiguous
    cells = 1 if table is None else table.shape[0]  # with a table: these arguments are the first cell's (types, strides)
    _flush_page_fwd_kernel[(b * h, 2 * cells, pages)](
        k_ptr=ring_key,
        v_ptr=ring_value,
        slots_ptr=slots,
        valid_ptr=valid if valid is not None else slots,  # any pointer; unused without USE_VALID
        coded_ptr=coded if coded is not None else slots,  # any pointer; unused without USE_CODED
        table_ptr=table if table is not None else slots,  # any pointer; unused without TABLE
        due_ptr=due,
        start_ptr=start,
        floor_ptr=floor,
        page_ptr=page,
        codes_ptr=keys.codes,
        kscale_ptr=keys.scale,
        kzero_ptr=keys.zero,
        hi_ptr=values.hi,
        lo_ptr=values.lo if values.lo is not None else values.hi,
        vscale_ptr=values.scale,
        vzero_ptr=values.zero,
        H=h,
        stride_kb=ring_key.stride(0),
        stride_kh=ring_key.stride(1),
        stride_kt=ring_key.stride(2),
        stride_kd=ring_key.stride(3),
        stride_vb=ring_value.stride(0),
        stride_vh=ring_value.stride(1),
        stride_vt=ring_value.stride(2),
        stride_vd=ring_value.stride(3),
        stride_mb=valid.stride(0) if valid is not None else 0,
        stride_mt=valid.stride(1) if valid is not None else 0,
        stride_cb=keys.codes.stride(0),
        stride_ch=keys.codes.stride(1),
        stride_ct=keys.codes.stride(2),
        stride_sb=keys.scale.stride(0),
        stride_sh=keys.scale.stride(1),
        stride_sg=keys.scale.stride(2),
        stride_hb=values.hi.stride(0),
        stride_hh=values.hi.stride(1),
        stride_ht=values.hi.stride(2),
        stride_wb=values.scale.stride(0),
        stride_wh=values.scale.stride(1),
        stride_wt=values.scale.stride(2),
        D=d,
        NBITS=keys.nbits,
        PAGE=p,
        GROUP=gs,
        BLOCK_P=next_pow2(p),
        BLOCK_C=next_pow2(d * keys.nbits // 8),
        BLOCK_NG=next_pow2(d // gs),
        BLOCK_K=next_pow2(gs // 4),
        USE_VALID=valid is not None,
        USE_CODED=coded is not None,
        TABLE=table is not None,
        **pdl_options(ring_key),
    )


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
    """Code `K` pages of a ring into page storage, in place: the flush of a static coded cell's forward. Same contract
    and bytes as `triton_ops.quant.naive.flush_page` (gather the ring slots, `quantize_keys` over each page with
    `valid`, `quantize_values`, write page `k` to page `page[k]` when `due[k] and start[k] >= floor`) on every page a
    reader reads; the bytes of `scratch_page` are unspecified (the reference sends the pages that are not due there,
    the kernel skips them).

    On CUDA tensors (with Triton) it is **one kernel launch** (`_flush_page_fwd_kernel`, grid `(B * H, 2, K)`) that
    reads the device-side geometry itself: no host read, no allocation, the same addresses every call, so it can be
    captured in a CUDA graph; the programs of a page that is not due exit at once, so a step that codes nothing costs
    the launch only (a page is due once every `P` steps). Elsewhere the reference runs (a dozen torch ops). Neither checks finiteness (a host
    read): the ring must hold finite values within the fp16 range at the page's valid positions.

    Args:
        ring_key, ring_value (`torch.Tensor` of shape `[B, H, C, D]`): the ring of full-precision positions, fp32 /
            fp16 / bf16, any strides.
        keys (`QuantizedKeys`): page storage, `codes` `[B', H, N * P, D * nbits // 8]`, `scale` / `zero`
            `[B', H, N, D]` (`B' >= B`, `N > scratch_page`, `P = keys.group_size`); rows `[0, B)` are written.
        values (`QuantizedValues`): page storage, `hi` (/ `lo` for INT4) `[B', H, N * P, D // 4]`, `scale` / `zero`
            `[B', H, N * P, D // values.group_size]`, the same `nbits` as `keys`.
        slots (`torch.LongTensor` of shape `[K * P]`): ring slots of the pages' positions, page by page (in position
            order; a ring wraps, so they need not be consecutive).
        page (`torch.LongTensor` of shape `[K]`, or `[]` / `[1]` for one page): destination pages when due.
        due (`torch.BoolTensor` of shape `[K]`): whether each page is due.
        start (`torch.LongTensor` of shape `[K]`), floor (`torch.LongTensor`, one element): each page's first position,
            and the lowest position the ring holds; a page below `floor` is not written.
        scratch_page (`int`): a page past every page a reader reads, where the reference writes the pages that are
            not written (device-side indexing, no host branch); its bytes are unspecified.
        valid (`torch.BoolTensor` of shape `[B, K * P]`, *optional*): False marks padding positions, left out of the
            key pages' min / max.
        coded (`torch.IntTensor` of shape `[B', H, 2, K]`, contiguous, *optional*): per row, head and plane (keys,
            values), the page last coded in each of `K` slots (page `n` in slot `n % K`; -1: none). A due page is
            coded only where its slot does not hold it yet, and its slot then does (each program owns its slot: no
            race, no atomics), so a forward in which no page became due codes nothing. The caller clears the slots of
            pages whose positions change (a crop into them, a reset). Without it every due page is coded.

    Example:
        >>> from triton_ops.quant import QuantizedKeys, QuantizedValues, flush_page
        >>> ring = torch.randn(1, 2, 40, 64)
        >>> z = lambda *s, dt=torch.uint8: torch.zeros(*s, dtype=dt)
        >>> keys = QuantizedKeys(z(1, 2, 96, 32), z(1, 2, 3, 64, dt=torch.float16), z(1, 2, 3, 64, dt=torch.float16), 4, 32)
        >>> values = QuantizedValues(z(1, 2, 96, 16), z(1, 2, 96, 16), z(1, 2, 96, 2, dt=torch.float16),
        ...                          z(1, 2, 96, 2, dt=torch.float16), 4, 32)
        >>> one = lambda v, dt=torch.long: torch.tensor([v], dtype=dt)
        >>> # sink 16, pages of 32: positions [48, 80) are page 1, in ring slots 8..39 and 0..7
        >>> flush_page(ring, ring, keys, values, slots=torch.arange(48, 80) % 40, page=one(1),
        ...            due=one(True, torch.bool), start=one(48), floor=one(16), scratch_page=2)
        >>> bool(keys.scale[:, :, 1].any())
        True
    """
    _check_flush(ring_key, ring_value, keys, values, slots, page, due, start, floor, scratch_page, valid, coded)
    if not use_triton("flush_page", ring_key):
        naive._flush_page(ring_key, ring_value, keys, values, slots, page, due, start, floor, scratch_page, valid, coded)
        return
    with launch_device(ring_key):  # the tensor's GPU, not the current one (multi-GPU `device_map`)
        _flush_page_fwd(ring_key, ring_value, keys, values, slots, page, due, start, floor, scratch_page, valid, coded)


class FlushTable:
    """The storage of several cells of one shape that `flush_page_table` codes in one launch: per cell its ring
    (`ring_key`, `ring_value`), page storage (`keys`, `values`), `floor` and `coded` slots, as `flush_page` takes
    them. A device table of their addresses (`[cells, 11]` int64) is built once here: the tensors must not
    move afterwards (a static cache's storage never does; build a new table when it is reallocated), and every cell's
    tensors must have the first cell's shapes, strides and dtypes (checked). (On the CPU the table serves the Triton
    interpreter.)

    Args:
        cells (`list` of `tuple`): per cell `(ring_key, ring_value, keys, values, floor, coded)`; `coded` may be None
            for every cell, or for none.
        scratch_page (`int`): as `flush_page` (the same for every cell).
    """

    FIELDS = 11

    def __init__(self, cells: list[tuple], scratch_page: int) -> None:
        if not cells:
            raise ValueError("`cells` must hold at least one cell's storage")
        self.cells, self.scratch_page = list(cells), scratch_page
        first = self._tensors(self.cells[0])
        if len({c[5] is None for c in self.cells}) > 1:
            raise ValueError("`coded` must be given for every cell or for none")
        for i, cell in enumerate(self.cells[1:], 1):
            for a, b_ in zip(first, self._tensors(cell)):
                if (a is None) != (b_ is None) or (a is not None and (a.shape, a.stride(), a.dtype, a.device) !=
                                                   (b_.shape, b_.stride(), b_.dtype, b_.device)):  # fmt: skip
                    raise ValueError(
                        f"cell {i} of `cells` must have the first cell's shapes, strides, dtypes and device for one "
                        "launch"
                    )
        rows = []
        for cell in self.cells:
            ts = self._tensors(cell)
            lo = ts[6] if ts[6] is not None else ts[5]
            coded = ts[10] if ts[10] is not None else ts[9]
            rows.append([t.data_ptr() for t in (*ts[:6], lo, *ts[7:10], coded)])  # type: ignore[union-attr]
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.cells[0][0].device)

    @staticmethod
    def _tensors(cell: tuple) -> list[Tensor | None]:
        ring_key, ring_value, keys, values, floor, coded = cell
        return [ring_key, ring_value, keys.codes, keys.scale, keys.zero, values.hi, values.lo, values.scale,
                values.zero, floor, coded]  # fmt: skip


def flush_page_table(
    table: FlushTable,
    *,
    slots: Tensor,
    page: Tensor,
    due: Tensor,
    start: Tensor,
    valid: Tensor | None = None,
) -> None:
    """`flush_page` of every cell of `table` with the same geometry (`slots`, `page`, `due`, `start`, `valid`): the
    same bytes and slots as one `flush_page` per cell, in **one launch** on CUDA (grid `(B * H, 2 * cells, K)`, each
    program reading its cell's addresses from the table; graph-safe as `flush_page` is). Elsewhere the reference, cell
    by cell."""
    ring_key, ring_value, keys, values, floor, coded = table.cells[0]  # the others have its shapes (FlushTable)
    _check_flush(ring_key, ring_value, keys, values, slots, page, due, start, floor, table.scratch_page, valid, coded)
    if not use_triton("flush_page", ring_key):
        for ring_key, ring_value, keys, values, floor, coded in table.cells:
            naive._flush_page(ring_key, ring_value, keys, values, slots, page, due, start, floor, table.scratch_page,
                              valid, coded)  # fmt: skip
        return
    with launch_device(ring_key):
        _flush_page_fwd(ring_key, ring_value, keys, values, slots, page, due, start, floor, table.scratch_page, valid,
                        coded, table.table)  # fmt: skip
