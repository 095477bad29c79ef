"""SASS of the one-row coded-attention loop for sm_90, compiled on any machine (no GPU needed).

Compiles `_coded_attention_fwd_kernel` with `triton.compile` for `GPUTarget("cuda", 90, 128)` with the argument
types and 16-byte divisibility hints a real decode launch gets (Ouro's 16 x 128 heads, bf16 queries, pages of 32,
value groups of 32), disassembles it with the `cuobjdump` that Triton ships, and prints the registers, spills and
the instructions of the history loop (the body of the hottest backward branch) by opcode, per step and per code
element (`NP * 32` tokens x 128 channels per step).

    python -m benchmarks.sass_coded_attention --fmt 4 --pages 2 --warps 2 [--vprec [--vpipe 1 [--scores 1] [--unroll 1]]]
        [--sub 2] [--maxnreg 168] [--sass out.sass]
    python -m benchmarks.sass_coded_attention --rows 5 [--general --pages 1 --warps 4 --stages 3]  # v7 blocks
    python -m benchmarks.sass_coded_attention --mma --warps 2 [--rows 5]  # v8: the tensor-core loop (16-row block)

`bar` / `shfl`: BAR / SHFL instructions per step; `programs_per_sm`: resident programs per SM by registers.

`ldg_use_distance`: for each global load of the loop, how many instructions later the first instruction that reads
it issues (across the back-edge; a register copy counts): a load read soon after its issue stalls the warp.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import tempfile


def compile_row1(fmt=4, pages=2, warps=2, stages=1, vprec=False, dtype="bf16", extra=None, maxnreg=None):
    """The cubin (bytes) and metadata of the fwd kernel's one-row path at these settings."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton_ops.coded_attention.kernels import _coded_attention_fwd_kernel as fn

    consts = dict(
        D=128, DH=128, PAGE=32, VGROUP=32, KV_FMT=fmt, BLOCK_R=16, BLOCK_T=32, BLOCK_PM=64, USE_VALID=False,
        USE_VPREC=vprec, COUNT=False, READ_PREFIX=False, PAGE_MAX_ONLY=False, IEEE=dtype == "fp32", ROW1=True,
        NP=pages, DEV_LEN=False, VPIPE=False, SCORES=False, VUNROLL=False, SUB=1, SUB_STAGES=0, ROWX=False, MMA=False,
        MMA_STAGES=1,
    )  # fmt: skip
    consts.update(extra or {})
    for k in consts:
        if k not in fn.arg_names:
            raise ValueError(f"`extra` names {k!r}, not a kernel argument")
    # every other constexpr at the kernel's default, as a launch that does not pass it compiles it (left out of
    # `consts`, it would compile as a runtime integer, with both sides of its branches in the code)
    consts.update({p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts})
    ptr_types = dict(
        q_ptr=dtype, o_ptr="fp32", lse_ptr="fp32", pmax_ptr="fp32", sc_ptr="fp32", bound_ptr="i32", valid_ptr="i32", hk_ptr="u8",
        hks_ptr="fp16", hkz_ptr="fp16", hv_ptr="u8", hvl_ptr="u8", hvs_ptr="fp16", hvz_ptr="fp16", stats_ptr="fp32",
        lb_ptr="i32", hmin_ptr="fp32",
    )  # fmt: skip
    # runtime integers of a real launch that are multiples of 16 (the rest are not specialised)
    div16 = {"stride_qb", "stride_qh", "stride_qq", "stride_skb", "stride_skh", "stride_skt", "stride_svb",
             "stride_svh", "stride_svt", "stride_wkb", "stride_wkh", "stride_wkt", "stride_wvb", "stride_wvh",
             "stride_wvt", "stride_nkb", "stride_nkh", "stride_nkt", "stride_nvb", "stride_nvh", "stride_nvt",
             "stride_hkb", "stride_hkh", "stride_hkt", "stride_hksb", "stride_hksh", "stride_hksp", "stride_hvb",
             "stride_hvh", "stride_hvt", "stride_hvsb", "stride_hvsh"}  # fmt: skip
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + ptr_types.get(name, dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "margin"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", 90, 128)
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        options["maxnreg"] = maxnreg  # ptxas's register cap (`ROW1_TUNING["maxnreg"]`)
    kernel = triton.compile(src, target=target, options=options)
    return kernel.asm["cubin"], kernel.metadata


def sass_of(cubin: bytes, what: str = "--dump-sass") -> str:
    tool = glob.glob(os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin/cuobjdump"))[0]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, what, f.name], capture_output=True, text=True, check=True).stdout


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def instructions(sass: str):
    """[(address, opcode with modifiers, operands)] in program order."""
    out = []
    for line in sass.splitlines():
        m = _INS.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return out


def hottest_loop(ins):
    """The instructions of the code loop: of the loops (backward branches), the one with the most LOP3 + FFMA (the
    field extraction and the multiply-adds; the dense tail's loops use HMMA)."""
    best, best_n = None, -1
    for addr, op, args in ins:
        m = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            n = sum(1 for a, o, _ in ins if lo <= a <= addr and o.startswith(("LOP3", "FFMA")))
            if n > best_n:
                best, best_n = (lo, addr), n
    if best is None:
        return []
    return [x for x in ins if best[0] <= x[0] <= best[1]]


_REG = re.compile(r"\bR(\d+)(\.64)?\b")
_NO_DEST = ("ST", "RED", "ATOM", "BRA", "BAR", "EXIT", "WARPSYNC", "BSYNC", "BSSY", "NOP", "DEPBAR", "CALL", "RET")


def _regs(text: str, wide: int = 1) -> set[int]:
    """Register numbers named in `text` (`R8.64` names R8 and R9)."""
    out = set()
    for m in _REG.finditer(text):
        n, w = int(m.group(1)), 2 if m.group(2) else wide
        out.update(range(n, n + w))
    return out


def load_use_distances(loop):
    """For each global load (LDG) of the loop: `(position, opcode, distance)`, the distance being the number of loop
    instructions issued from the load to the first one that reads a register it writes, following the back-edge
    into the next iteration (None: not read within one trip around the loop). A load consumed a few instructions
    after its issue stalls its warp for the memory latency; one consumed in the next iteration (a prefetch) does not."""
    out = []
    n = len(loop)
    for i, (_, op, args) in enumerate(loop):
        if not op.startswith("LDG"):
            continue
        wide = 4 if ".128" in op else 2 if ".64" in op else 1
        dest = _regs(args.split(",")[0], wide)
        dist = None
        for k in range(1, n):
            _, op2, args2 = loop[(i + k) % n]
            parts = args2.split(",")
            srcs = ",".join(parts if op2.startswith(_NO_DEST) else parts[1:])
            if _regs(srcs) & dest:
                dist = k
                break
            if not op2.startswith(_NO_DEST) and parts and _regs(parts[0]) >= dest:
                break  # overwritten before any read (a masked load's zero fill of the next trip)
        out.append((i, op, dist))
    return out


def programs_per_sm(regs: int, warps: int, smem: int = 0) -> int:
    """Resident programs per SM of sm_90 allowed by registers (64K per SM, allocated per warp in units of 256), by
    shared memory (228 KiB per SM, 1 KiB of it reserved per program) and by the 64 warps / 32 blocks an SM holds."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 233472 // (smem + 1024), 64 // warps, 32)


def report(
    fmt=4, pages=2, warps=2, stages=1, vprec=False, dtype="bf16", sass_path=None, extra=None, maxnreg=None, rows=1
):
    """The loop's counts; `rows`: the query rows per KV head of a verification block the launch serves (v7): with
    `ROW1` off (the general path: one program per row block of `BLOCK_R` >= 16 rows) every loop step serves all of
    them, with `ROWX` (one program per row, the word loop) one, so `per_element_row` divides by `rows` or by 1."""
    cubin, meta = compile_row1(fmt, pages, warps, stages, vprec, dtype, extra, maxnreg)
    sass = sass_of(cubin)
    if sass_path:
        with open(sass_path, "w") as f:
            f.write(sass)
    ins = instructions(sass)
    loop = hottest_loop(ins)
    # the hot path: leave out forward branches inside the loop (the rare move of the softmax reference)
    skip = set()
    for addr, op, args in loop:
        m = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if m and addr < int(m.group(1), 16) <= loop[-1][0]:
            skip.update(a for a, _, _ in loop if addr < a < int(m.group(1), 16))
    loop = [x for x in loop if x[0] not in skip]
    ops = collections.Counter(op.split(".")[0] for _, op, _ in loop)
    mma_ops = sum(n for op, n in ops.items() if op in ("HMMA", "HGMMA"))
    elements = 2 * pages * 32 * 128 // (extra or {}).get("SUB", 1)  # key and value code elements of one step
    res = sass_of(cubin, "--dump-resource-usage")
    n_regs = int(re.search(r"REG:(\d+)", res).group(1))
    n_spills = int(re.search(r"STACK:(\d+)", res).group(1))
    stl = sum(1 for _, op, _ in ins if op.startswith(("STL", "LDL")))
    ldg = [i for i, (_, op, _) in enumerate(loop) if op.startswith("LDG")]
    per_element = len(loop) * warps * 32 / elements
    row1 = (extra or {}).get("ROW1", True)
    return dict(
        fmt=fmt, pages=pages, warps=warps, vprec=vprec, dtype=dtype, total=len(ins), loop=len(loop),
        per_element=per_element, per_element_row=per_element / (1 if row1 else rows), regs=n_regs, stack=n_spills, local_ins=stl,
        loop_local=ops.get("LDL", 0) + ops.get("STL", 0), bar=ops.get("BAR", 0), shfl=ops.get("SHFL", 0),
        smem=meta.shared, programs_per_sm=programs_per_sm(n_regs, warps, meta.shared),
        ldg_positions=(ldg[0] if ldg else None, ldg[-1] if ldg else None),
        ldg_ops=[op for _, op, _ in loop if op.startswith("LDG")],
        ldg_use_distance=[d for _, _, d in load_use_distances(loop)], ops=dict(ops.most_common(16)), mma=mma_ops,
        lds=ops.get("LDS", 0) + ops.get("LDSM", 0), sts=ops.get("STS", 0),
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fmt", type=int, default=4)
    p.add_argument("--pages", type=int, default=2)
    p.add_argument("--warps", type=int, default=2)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--vprec", action="store_true")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--words", type=int, default=1, help="1: the v4 word path (WORDS), 0: v3")
    p.add_argument("--vpipe", type=int, default=0, help="1: v5's pipelined V-precision loop (VPIPE, with --vprec)")
    p.add_argument(
        "--scores", type=int, default=0, help="1: v5's value pass over stored scores (SCORES + READ_PREFIX; --vpipe 1)"
    )
    p.add_argument("--unroll", type=int, default=0, help="1: v5's loop two steps per iteration (VUNROLL; --vpipe 1)")
    p.add_argument("--maxnreg", type=int, default=None, help="ptxas's register cap per thread (`ROW1_TUNING['maxnreg']`)")
    p.add_argument("--sub", type=int, default=1, help="v6: steps per page (SUB, `ROW1_TUNING['sub']`; --pages 1)")
    p.add_argument("--sub-stages", type=int, default=0, help="v6: SUB_STAGES (`ROW1_TUNING['sub_stages']`)")
    p.add_argument(
        "--rows", type=int, default=1,
        help="v7: query rows per KV head of a verification block (> 1: the word loop per row, `ROWX`; with "
        "--general, the general path's row-block loop); `per_element_row`: instructions per code element per row",
    )  # fmt: skip
    p.add_argument(
        "--general", action="store_true",
        help="the general path (ROW1 off, byte reads, row blocks of 16, tl.dot; one page per step; the launcher uses "
        "Triton's defaults, 4 warps and 3 stages: pass --warps 4 --stages 3)",
    )  # fmt: skip
    p.add_argument(
        "--mma", action="store_true",
        help="v8: the tensor-core loop (`ROW1_TUNING['mma']`: ROW1 off, MMA on, a block of 16 rows, one page per step; "
        "`per_element_row` divides by --rows, the rows a block serves)",
    )  # fmt: skip
    p.add_argument("--sass", default=None, help="write the whole SASS here")
    a = p.parse_args(argv)
    extra = {"WORDS": bool(a.words), "VPIPE": bool(a.vpipe), "SCORES": bool(a.scores), "READ_PREFIX": bool(a.scores)}
    extra["VUNROLL"] = bool(a.unroll)
    extra["SUB"] = a.sub
    extra["SUB_STAGES"] = a.sub_stages
    if a.general or a.mma:
        extra.update(ROW1=False, WORDS=False, SUB=1, MMA=a.mma)
        a.pages = 1
    elif a.rows > 1:
        extra["ROWX"] = True
    r = report(a.fmt, a.pages, a.warps, a.stages, a.vprec, a.dtype, a.sass, extra, a.maxnreg, a.rows)
    for k, v in r.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
