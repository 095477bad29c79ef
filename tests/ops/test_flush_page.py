"""`flush_page`, the flush of a static coded cell's decode step: one page gathered from a ring, quantized and written
to its page (or the scratch page) of the page storage.

The expected storage is stated independently here: `naive.quantize_keys` / `quantize_values` of the page's positions
(gathered by position, not by the op's slots) copied into page `page` when `due and start >= floor`, else into the
scratch page, every other byte untouched (the storage starts as random bytes). The reference (`naive.flush_page`, the
CPU path) and the fused Triton kernel (CUDA, or the CPU under `TRITON_INTERPRET=1`: `test_triton_interpreter.py`)
must both give it bit for bit: INT4 (`hi` and `lo` planes) and INT2, fp32 / fp16 (bf16 on CUDA), due and not due,
partial validity masks with NaN / inf at padding, pages at the first and last index, a ring that wraps inside the page.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.helpers import compile_for_sm90
from tests.ops.test_quant_kernels import _data, _same_bits
from triton_ops.quant import QuantizedKeys, QuantizedValues, flush_page, naive

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 (see test_triton_interpreter)"
)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 2
    H: int = 2
    D: int = 64
    P: int = 8  # positions per page (key group)
    G: int = 16  # value channel group
    C: int = 21  # ring slots
    N: int = 4  # readable pages; page N is the scratch page
    first: int = 37  # the page's first position (its slots are `(first + i) % C`)
    page: int = 2
    due: bool = True
    floor: int = 10
    mask: str = "none"  # none | partial | empty-row
    K: int = 1  # pages per call: page k starts at `first + k * P` and goes to page `page + k`

    def id(self) -> str:
        held = "" if self.first >= self.floor else "-unheld"
        return (f"B{self.B}-H{self.H}-D{self.D}-P{self.P}-G{self.G}-page{self.page}{'' if self.due else '-notdue'}"
                f"{held}-wrap{int((self.first % self.C) + self.K * self.P > self.C)}-{self.mask}-K{self.K}")  # fmt: skip


CASES = [
    Case(),  # slots 16..20, 0..2: the ring wraps inside the page
    Case(first=40, page=0, mask="partial"),  # the first page
    Case(first=8, page=3, mask="empty-row", floor=8),  # the last readable page, a row with no valid position
    Case(due=False, mask="partial"),  # nothing due: the scratch page
    Case(floor=45, mask="partial"),  # the ring no longer holds the page: the scratch page
    Case(B=1, H=3, D=32, P=8, G=32, C=11, N=2, first=7, page=1),  # one row, one value group, a short ring
    Case(B=3, H=1, D=128, P=32, G=32, C=70, N=3, first=50, page=2, mask="partial"),  # LoopKV's page and group
    Case(K=3, C=30, first=37, page=1, floor=45, mask="partial"),  # 3 pages a call, the first no longer held, wrapping
    Case(K=2, C=30, first=20, page=0, mask="empty-row"),
    # Huginn-0125's head dim 96 (no power of two): 3 value groups of 32 and 48 / 24 key bytes, read in padded tiles
    Case(B=2, H=2, D=96, P=32, G=32, C=40, N=3, first=50, page=1, mask="partial"),
]


def _store(case: Case, nbits: int, seed: int):
    """Page storage for `B + 1` rows (the last one must stay untouched) holding random bytes."""
    g = torch.Generator().manual_seed(seed)
    rows, tokens, pages = case.B + 1, (case.N + 1) * case.P, case.N + 1
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    f16 = lambda *s: torch.randn(*s, generator=g).to(torch.float16)  # noqa: E731
    keys = QuantizedKeys(u8(rows, case.H, tokens, case.D * nbits // 8), f16(rows, case.H, pages, case.D),
                         f16(rows, case.H, pages, case.D), nbits, case.P)  # fmt: skip
    values = QuantizedValues(
        u8(rows, case.H, tokens, case.D // 4), u8(rows, case.H, tokens, case.D // 4) if nbits == 4 else None,
        f16(rows, case.H, tokens, case.D // case.G), f16(rows, case.H, tokens, case.D // case.G), nbits, case.G,
    )  # fmt: skip
    return keys, values


def _to(store, device):
    keys, values = store
    move = lambda t: None if t is None else t.to(device).clone()  # noqa: E731
    return (
        QuantizedKeys(move(keys.codes), move(keys.scale), move(keys.zero), keys.nbits, keys.group_size),
        QuantizedValues(move(values.hi), move(values.lo), move(values.scale), move(values.zero), values.nbits,
                        values.group_size),  # fmt: skip
    )


def _inputs(case: Case, nbits: int, dtype: torch.dtype, seed: int = 0):
    """The ring (the page's positions hold `_data`'s awkward values: ties, exact zeros, -0.0, constant rows,
    reciprocal traps; the other slots random), the geometry, the validity (padding keys hold NaN / inf)."""
    g = torch.Generator().manual_seed(seed + 7)
    n = case.K * case.P
    page_k = torch.cat([_data((case.B, case.H, case.P, case.D), torch.float32, seed + 2 * k, nbits, case.G)
                        for k in range(case.K)], dim=2)  # fmt: skip
    page_v = torch.cat([_data((case.B, case.H, case.P, case.D), torch.float32, seed + 2 * k + 1, nbits, case.G)
                        for k in range(case.K)], dim=2)  # fmt: skip
    ring_k = torch.randn(case.B, case.H, case.C, case.D, generator=g) * 5
    ring_v = torch.randn(case.B, case.H, case.C, case.D, generator=g) * 5
    positions = torch.arange(case.first, case.first + n)
    slots = positions % case.C
    valid = None
    if case.mask != "none":
        valid = torch.rand(case.B, n, generator=g) > 0.4
        valid[:, 0] = True
        if case.mask == "empty-row":
            valid[-1] = False
        page_k = page_k.masked_fill(~valid[:, None, :, None], float("nan"))
        page_k[:, :, 1] = torch.where(valid[:, None, 1, None], page_k[:, :, 1], float("inf"))
    ring_k[:, :, slots], ring_v[:, :, slots] = page_k, page_v
    ks = torch.arange(case.K)
    geo = dict(slots=slots, page=case.page + ks, due=torch.full((case.K,), case.due), start=case.first + case.P * ks,
               floor=torch.tensor(case.floor), scratch_page=case.N, valid=valid)  # fmt: skip
    return ring_k.to(dtype), ring_v.to(dtype), geo


def _expected(case: Case, nbits: int, ring_k, ring_v, geo, store):
    """The independent statement: quantize the page's positions and copy them to the page the geometry picks."""
    keys, values = _to(store, "cpu")
    for i in range(case.K):  # page by page, each quantized on its own
        first = case.first + i * case.P
        slots = torch.arange(first, first + case.P) % case.C
        k, v = ring_k[:, :, slots].cpu(), ring_v[:, :, slots].cpu()
        valid = None if geo["valid"] is None else geo["valid"][:, i * case.P : (i + 1) * case.P]
        qk = naive.quantize_keys(k, nbits, group_size=case.P, valid=valid, check_finite=False)
        qv = naive.quantize_values(v, nbits, group_size=case.G)
        dst = case.page + i if case.due and first >= case.floor else case.N
        b, t0, t1 = case.B, dst * case.P, (dst + 1) * case.P
        keys.codes[:b, :, t0:t1] = qk.codes
        keys.scale[:b, :, dst] = qk.scale[:, :, 0]
        keys.zero[:b, :, dst] = qk.zero[:, :, 0]
        values.hi[:b, :, t0:t1] = qv.hi
        values.scale[:b, :, t0:t1] = qv.scale
        values.zero[:b, :, t0:t1] = qv.zero
        if nbits == 4:
            values.lo[:b, :, t0:t1] = qv.lo
    return keys, values


def _assert_same_store(got, want, scratch: int):
    """Every byte of pages `[0, scratch)` equal; the scratch page's bytes are unspecified (the reference writes the
    pages that are not due there, the kernel skips them)."""
    for part_got, part_want, side in ((got[0], want[0], "keys"), (got[1], want[1], "values")):
        for field in ("codes", "scale", "zero") if side == "keys" else ("hi", "lo", "scale", "zero"):
            a, b = getattr(part_got, field), getattr(part_want, field)
            if a is None or b is None:
                assert a is None and b is None, f"{side}.{field}"
                continue
            per_page = a.shape[2] // (scratch + 1)  # page-indexed metadata (keys' scale / zero) or positions
            assert _same_bits(a[:, :, : scratch * per_page], b[:, :, : scratch * per_page]), f"{side}.{field}"


def _params():
    return [pytest.param(c, id=c.id()) for c in CASES]


@pytest.mark.parametrize("case", _params())
@pytest.mark.parametrize("nbits", [2, 4], ids=["bits2", "bits4"])
def test_flush_page_reference_writes_the_page_it_picks(case, nbits):
    """The reference (the CPU path of `flush_page`) against the independent statement."""
    ring_k, ring_v, geo = _inputs(case, nbits, torch.float32)
    store = _store(case, nbits, 3)
    want = _expected(case, nbits, ring_k, ring_v, geo, store)
    got = _to(store, "cpu")
    flush_page(ring_k, ring_v, *got, **geo)
    _assert_same_store(got, want, case.N)


@needs_kernel
@pytest.mark.parametrize("case", _params())
@pytest.mark.parametrize("nbits", [2, 4], ids=["bits2", "bits4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).split(".")[1] for d in DTYPES])
def test_flush_page_kernel_bit_exact(case, nbits, dtype):
    """The fused kernel (one launch) writes the same bytes as the reference, and nothing else."""
    from triton_ops.quant.ops import _flush_page_fwd

    ring_k, ring_v, geo = _inputs(case, nbits, dtype)
    store = _store(case, nbits, 3)
    want = _expected(case, nbits, ring_k, ring_v, geo, store)
    ref = _to(store, "cpu")
    naive.flush_page(ring_k, ring_v, *ref, **geo)
    _assert_same_store(ref, want, case.N)
    got = _to(store, DEVICE)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in geo.items()}
    # a strided ring (the cell passes views of its first rows): read in place
    strided = lambda x: x.transpose(2, 3).contiguous().transpose(2, 3).to(DEVICE)  # noqa: E731
    _flush_page_fwd(strided(ring_k), strided(ring_v), *got, dev["slots"], dev["page"], dev["due"], dev["start"],
                    dev["floor"], dev["scratch_page"], dev["valid"])  # fmt: skip
    _assert_same_store(_to(got, "cpu"), want, case.N)


@needs_kernel
@pytest.mark.parametrize("case", _params())
@pytest.mark.parametrize("nbits", [2, 4], ids=["bits2", "bits4"])
def test_flush_page_kernel_with_coded_slots_bit_exact(case, nbits):
    """With `coded` slots (some holding their page already, some not, one more row than written): the kernel writes
    the same bytes as the reference and leaves the same slots; a (row, head, plane) whose slot held the page keeps the
    page's old bytes."""
    from triton_ops.quant.ops import _flush_page_fwd

    ring_k, ring_v, geo = _inputs(case, nbits, torch.float32)
    store = _store(case, nbits, 3)
    g = torch.Generator().manual_seed(5)
    pages = geo["page"].reshape(-1)  # [K]
    held = torch.rand(case.B + 1, case.H, 2, case.K, generator=g) < 0.5
    coded = torch.full((case.B + 1, case.H, 2, case.K), -1, dtype=torch.int32)
    coded[..., pages % case.K] = torch.where(held, pages.to(torch.int32), -1)
    ref, ref_coded = _to(store, "cpu"), coded.clone()
    naive.flush_page(ring_k, ring_v, *ref, **geo, coded=ref_coded)
    got, got_coded = _to(store, DEVICE), coded.to(DEVICE)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in geo.items()}
    _flush_page_fwd(ring_k.to(DEVICE), ring_v.to(DEVICE), *got, dev["slots"], dev["page"], dev["due"], dev["start"],
                    dev["floor"], dev["scratch_page"], dev["valid"], got_coded)  # fmt: skip
    _assert_same_store(_to(got, "cpu"), ref, case.N)
    assert torch.equal(got_coded.cpu(), ref_coded)
    written = geo["due"] & (geo["start"] >= geo["floor"])  # [K]
    holds = ref_coded[: case.B][..., pages % case.K] == pages.to(torch.int32)  # [B, H, 2, K], page k's slot
    assert torch.equal(holds, written | held[: case.B])
    assert torch.equal(ref_coded[case.B :], coded[case.B :])
    if written[0]:  # a (row, head, plane) whose slot held the page: its old key bytes stay
        t0 = case.page * case.P
        for b in range(case.B):
            for h in range(case.H):
                if held[b, h, 0, 0]:
                    assert torch.equal(ref[0].codes[b, h, t0 : t0 + case.P], store[0].codes[b, h, t0 : t0 + case.P])


@needs_kernel
@pytest.mark.parametrize("case", _params())
@pytest.mark.parametrize("nbits", [2, 4], ids=["bits2", "bits4"])
def test_flush_page_table_one_launch_equals_one_call_per_cell(case, nbits, monkeypatch):
    """`flush_page_table` over three cells (their own rings, storage, floors and slots) launches the kernel once and
    writes the bytes and slots of one reference `flush_page` per cell."""
    from triton_ops.quant import ops
    from triton_ops.quant.ops import FlushTable, flush_page_table

    geo = _inputs(case, nbits, torch.float32)[2]
    cells, refs = [], []
    for i in range(3):
        ring_k, ring_v, _ = _inputs(dataclasses.replace(case), nbits, torch.float32)
        ring_k, ring_v = ring_k + i, ring_v * (i + 1)
        store = _store(case, nbits, 3 + i)
        coded = torch.full((case.B + 1, case.H, 2, case.K), -1, dtype=torch.int32)
        coded[: case.B, :, i % 2] = geo["page"].reshape(-1)[0].to(torch.int32) if i else -1  # some slots hold a page
        floor = torch.tensor(case.floor + (case.P if i == 2 else 0))  # the third cell's ring holds less
        ref, ref_coded = _to(store, "cpu"), coded.clone()
        naive.flush_page(ring_k, ring_v, *ref, **{**geo, "floor": floor}, coded=ref_coded)
        refs.append((ref, ref_coded))
        cells.append((ring_k.to(DEVICE), ring_v.to(DEVICE), *_to(store, DEVICE), floor.to(DEVICE), coded.to(DEVICE)))
    launches = []
    kernel = ops._flush_page_fwd
    monkeypatch.setattr(ops, "_flush_page_fwd", lambda *a: launches.append(1) or kernel(*a))
    monkeypatch.setattr(ops, "use_triton", lambda op, *t: True)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in geo.items()}
    table = FlushTable(cells, scratch_page=case.N)
    flush_page_table(table, slots=dev["slots"], page=dev["page"], due=dev["due"], start=dev["start"],
                     valid=dev["valid"])  # fmt: skip
    assert launches == [1]
    for cell, (ref, ref_coded) in zip(cells, refs):
        _assert_same_store(_to((cell[2], cell[3]), "cpu"), ref, case.N)
        assert torch.equal(cell[5].cpu(), ref_coded)


def test_flush_table_errors_name_the_argument():
    from triton_ops.quant.ops import FlushTable

    case = Case()
    ring_k, ring_v, _ = _inputs(case, 4, torch.float32)
    keys, values = _store(case, 4, 3)
    floor = torch.tensor(case.floor)
    with pytest.raises(ValueError, match="`cells` must hold at least one"):
        FlushTable([], scratch_page=case.N)
    with pytest.raises(ValueError, match="cell 1 of `cells` must have the first cell's shapes"):
        FlushTable([(ring_k, ring_v, keys, values, floor, None), (ring_k[:1], ring_v[:1], keys, values, floor, None)],
                   scratch_page=case.N)  # fmt: skip
    coded = torch.full((case.B, case.H, 2, case.K), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="`coded` must be given for every cell or for none"):
        FlushTable([(ring_k, ring_v, keys, values, floor, coded), (ring_k, ring_v, keys, values, floor, None)],
                   scratch_page=case.N)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="dispatch to Triton needs CUDA")
def test_flush_page_dispatches_to_the_kernel_on_cuda(monkeypatch):
    from triton_ops.quant import ops

    calls = []
    monkeypatch.setattr(ops, "_flush_page_fwd", lambda *a: calls.append("fused"))
    monkeypatch.setattr(naive, "_flush_page", lambda *a: calls.append("reference"))
    case = Case()
    ring_k, ring_v, geo = _inputs(case, 4, torch.float32)
    dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in geo.items()}
    flush_page(ring_k.cuda(), ring_v.cuda(), *_to(_store(case, 4, 0), "cuda"), **dev)
    flush_page(ring_k, ring_v, *_store(case, 4, 0), **geo)
    assert calls == ["fused", "reference"]


def test_flush_page_errors_name_the_argument():
    case = Case()
    ring_k, ring_v, geo = _inputs(case, 4, torch.float32)
    store = _store(case, 4, 0)

    def call(**overrides):
        flush_page(overrides.pop("ring_k", ring_k), ring_v, *overrides.pop("store", store), **{**geo, **overrides})

    with pytest.raises(ValueError, match="`slots` holds 5 positions but 1 page"):
        call(slots=geo["slots"][:5])
    with pytest.raises(TypeError, match="`due` must be a bool tensor of 1 element"):
        call(due=torch.tensor([1]))
    with pytest.raises(TypeError, match="`page` must be a int64 / int32 tensor"):
        call(page=torch.tensor([1.0]))
    with pytest.raises(TypeError, match="`start` must be a int64 / int32 tensor of 1 element"):
        call(start=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="`valid` must have shape"):
        call(valid=torch.ones(case.B, case.P + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="`keys.codes` must hold .* scratch page 5"):
        call(scratch_page=5)
    with pytest.raises(TypeError, match="`scratch_page` must be a non-negative int"):
        call(scratch_page=-1)
    with pytest.raises(ValueError, match="`keys.nbits` \\(2\\) and `values.nbits` \\(4\\)"):
        call(store=(_store(case, 2, 0)[0], store[1]))
    with pytest.raises(ValueError, match="`ring_key` and `ring_value` must have the same shape"):
        call(ring_k=ring_k[:, :, :5])


@pytest.mark.skipif(INTERPRET, reason="compiles with Triton's compiler, not the interpreter")
@pytest.mark.parametrize("coded", [False, True], ids=["every-due-page", "coded-slots-table"])
@pytest.mark.parametrize("nbits", [2, 4], ids=["bits2", "bits4"])
@pytest.mark.parametrize("d", [128, 96], ids=["D128", "D96"])
def test_flush_kernel_compiles_for_sm90(nbits, coded, d):
    """The interpreter runs Python, not Triton's compiler (which, e.g., needs one type per name across a branch):
    compile the kernel for sm_90 as a decode step launches it (bf16 ring, Ouro's 128 channels or Huginn-0125's 96 in
    padded tiles, pages and groups of 32, a validity mask, with and without the `coded` slots and the cell table; the
    static step's launch, with the slots and the table, also with programmatic dependent launch), with no GPU."""
    from triton_ops._dispatch import next_pow2
    from triton_ops.quant.kernels import _flush_page_fwd_kernel as fn

    consts = dict(D=d, NBITS=nbits, PAGE=32, GROUP=32, BLOCK_P=32, BLOCK_C=next_pow2(d * nbits // 8),
                  BLOCK_NG=next_pow2(d // 32), BLOCK_K=8, USE_VALID=True, USE_CODED=coded, TABLE=coded,
                  USE_PDL=coded)  # fmt: skip
    ptr = dict(k_ptr="bf16", v_ptr="bf16", slots_ptr="i64", valid_ptr="i1", due_ptr="i1", start_ptr="i64",
               floor_ptr="i64", page_ptr="i64", codes_ptr="u8", kscale_ptr="fp16", kzero_ptr="fp16", hi_ptr="u8",
               lo_ptr="u8", vscale_ptr="fp16", vzero_ptr="fp16", coded_ptr="i32", table_ptr="i64")  # fmt: skip
    compiled = compile_for_sm90(fn, consts, ptr, **({"launch_pdl": True} if coded else {}))
    assert compiled.asm.get("cubin")
    assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == coded


@pytest.mark.skipif(INTERPRET, reason="compiles with Triton's compiler, not the interpreter")
@pytest.mark.parametrize("kind", ["keys", "keys-valid", "values"])
@pytest.mark.parametrize("nbits", [2, 4], ids=["bits2", "bits4"])
def test_quantize_kernels_compile_for_sm90(kind, nbits):
    """The page quantizers (which share their group-code helpers with the static flush) compile for sm_90 as a
    prefill launches them (bf16, Ouro's 128 channels, pages and groups of 32), with no GPU."""
    from triton_ops.quant import kernels

    if kind.startswith("keys"):
        fn = kernels._quantize_keys_fwd_kernel
        consts = dict(D=128, NBITS=nbits, GROUP=32, BLOCK_G=32, BLOCK_C=16 * nbits, USE_VALID=kind == "keys-valid")
        ptr = dict(x_ptr="bf16", valid_ptr="i1", codes_ptr="u8", scale_ptr="fp16", zero_ptr="fp16")
    else:
        fn = kernels._quantize_values_fwd_kernel
        consts = dict(D=128, NBITS=nbits, GROUP=32, BLOCK_T=16, BLOCK_NG=4, BLOCK_K=8)
        ptr = dict(x_ptr="bf16", hi_ptr="u8", lo_ptr="u8", scale_ptr="fp16", zero_ptr="fp16")
    assert compile_for_sm90(fn, consts, ptr).asm.get("cubin")
