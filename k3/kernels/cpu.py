"""The CPU the kernels compile for: the instruction-set path (``kernel_isa``), the
maker (``cpu_vendor``), and the tuning constants that follow from them (tile shapes,
rows per block, prefetch choices). None of them changes a result, only speed.
"""

from __future__ import annotations

import numba


#: fp32 accumulator lanes of the canonical dot-product order. Part of the numeric
#: contract: changing it changes the bits every caller gets.
LANES = 64

# Blocking (performance only; none of these changes a single output bit).
_RB1 = 32    # rows per prange iteration, T = 1
_RB = 24     # weight rows per block (one prange iteration), T > 1 (a multiple of every _NR)
_KC = 2048   # K-chunk (elements, multiple of LANES) of the T > 1 tiles
_ST = 16     # tokens whose tiles take each K-chunk of a row block in turn, T > 1 (a multiple of every _NT)
#: ``make_tile``'s prefetch distance given at run time (its last argument)
PF_ARG = -2


def kernel_isa() -> str:
    """The instruction set the kernels are compiled for: "avx512" (AVX-512F/BW: 16-lane
    tiles, 64-byte shuffles), "avx2" (AVX2 + FMA: 8-lane tiles, 32-byte shuffles) or
    "generic" (4-lane tiles, plain vector arithmetic), from the CPU features numba
    compiles for (NUMBA_CPU_FEATURES when set, else the host's). K3_KERNEL_ISA forces a
    path those features allow (tests compare them; every path gives the same bits)."""
    from llvmlite import binding

    from .. import env
    if numba.config.CPU_FEATURES:
        feats = {f[1:]: f[0] == "+" for f in numba.config.CPU_FEATURES.split(",") if f[:1] in "+-" and f[1:]}
    else:
        feats = binding.get_host_cpu_features()
    have = ["generic"] + (["avx2"] if feats.get("avx2") and feats.get("fma") else [])
    have += ["avx512"] if len(have) == 2 and feats.get("avx512f") and feats.get("avx512bw") else []
    want = env.kernel_isa()
    if want is None:
        return have[-1]
    if want not in have:
        raise ValueError(f"K3_KERNEL_ISA={want}: the CPU features numba compiles for offer {', '.join(have)}")
    return want


def cpu_vendor() -> str:
    """"intel", "amd" or "" (unknown): the CPU's maker (k3.cpuinfo), for the few tuning
    choices (never results) where their memory systems differ."""
    from ..cpuinfo import cpuinfo
    return cpuinfo().vendor


def kernel_path() -> dict:
    """What the BF16 kernels run here, for ``k3 doctor``: the instruction-set path, the
    token x row tile of T > 1, the rows one token streams at once and from which K,
    the vendor tuning in force."""
    pf = [f"{'one row' if n == 1 else f'{n} rows'} at a time prefetch{'es' if n == 1 else ''} "
          + (f"the next {n} rows" if d == NEXT_ROWS else f"{d * 2} bytes ahead")
          for n, d in ((_T1_NR, _T1_PF), (1, _T1_PF1)) if d]
    if _TILE_NEXT:
        pf.append("the T > 1 tiles prefetch the rows they read next")
    return {"isa": _ISA, "lanes": _V, "tile": f"{_NT}x{_NR}", "t1_rows": _T1_NR,
            "t1_rows_from_k": _T1_MANY_K if _T1_MANY_K < 1 << 62 else None,
            "vendor": cpu_vendor(), "vendor_tuning": pf}


#: fp32 lanes of one register for each kernel_isa() path
VECTOR_LANES = {"avx512": 16, "avx2": 8, "generic": 4}


def pair_split(v: int) -> list[int]:
    """The lane permutation of the even/odd BF16 tiles with ``v``-lane registers:
    position ``2v*q + v*p + i`` holds canonical lane / element ``2v*q + 2i + p`` of each
    64-element step (a 32-bit load of two bf16 gives the even element by a shift and the
    odd one by a mask, so the tiles keep even and odd elements in separate registers).
    Returned as the list perm with perm[position] = canonical lane."""
    return [2 * v * q + 2 * i + p for q in range(LANES // (2 * v)) for p in range(2) for i in range(v)]

#: register tiles (tokens x rows) per path: nt * nr accumulators + nr weight vectors +
#: one activation vector fit the register file (32 zmm with AVX-512, 16 ymm with AVX2)
_ISA = kernel_isa()
_NT, _NR = {"avx512": (4, 3), "avx2": (2, 2), "generic": (2, 1)}[_ISA]
_V = VECTOR_LANES[_ISA]
PAIR_SPLIT = pair_split(_V)
#: how far ahead (elements) the T > 1 tiles prefetch the weight rows they read, passed
#: at run time (``_bf16_grouped``). On Intel (_TILE_NEXT) the weights the thread reads
#: next: the next rows' same columns, the block's next K-chunk, the next block. A fixed
#: distance in the same row left the start of every row's chunk (4 KiB, in a page of its
#: own: Intel's hardware streamer stops at each page) unfetched, and the next K-chunk
#: (AVX2's distance) the first chunk. Elsewhere the fixed distances: on AVX-512 (Zen 4) a
#: short one in the same row beat the next K-chunk; AVX2 the chunk (docs/PERFORMANCE.md,
#: "Kernels").
_TILE_NEXT = cpu_vendor() == "intel"
_TILE_PF = {"avx512": 256}.get(_ISA, _KC)
#: the next rows are read after the tile's whole chunk: into L2 (the chunk of x stays in L1)
_TILE_LOC = 2 if _TILE_NEXT else 3


#: ``make_dotn_bf16``'s prefetch of the next rows' same columns
NEXT_ROWS = -1


#: T = 1 streams several rows at once when K is at least _T1_MANY_K (more streams in
#: flight keep the memory busier, and each activation load serves more rows), on AVX-512
#: and AVX2 alike; never on the generic path. Short rows go one at a time: on AVX2 one
#: row's 64 lanes already take 8 of its 16 registers and four rows spill accumulators
#: every step; on AVX-512 short rows are streams too short for the hardware prefetcher.
#: AVX-512 takes eight rows (32 accumulators: a few spill to L1, which costs less than
#: the activation lines each step re-reads from L2 for every four rows); AVX2 four
#: (docs/PERFORMANCE.md, "Kernels").
_T1_NR = {"avx512": 8, "avx2": 4}.get(_ISA, 4)
#: On Intel's AVX-512 cores the eight rows start at K = 1024 and prefetch: there the
#: hardware streamer, which stops at every 4 KiB page, leaves unprefetched streams short,
#: one row's stream most of all; on Zen 4 a prefetch in the four-row dot was slower.
#: They prefetch the next eight rows' same columns (NEXT_ROWS: one sequential stream
#: ahead of the eight they read), which beat a distance ahead in each row and one row
#: at a time from K = 1024; below it, with the weights partly in the L3, one row at a
#: time stayed faster (docs/PERFORMANCE.md, "Kernels").
_T1_INTEL = _ISA == "avx512" and cpu_vendor() == "intel"
_T1_PF = NEXT_ROWS if _T1_INTEL else 0
#: ... and the one-row dot (short rows, which stream one after another: one stream per
#: thread) prefetches 1024 elements (2 KiB) ahead on Intel, into the next rows: with the
#: weights partly in the shared L3, as in a small model's decode, faster; from memory
#: about even (docs/PERFORMANCE.md, "Kernels")
_T1_PF1 = 1024 if _T1_INTEL else 0
_T1_MANY_K = 1024 if _T1_INTEL else {"avx512": 4096, "avx2": 4096}.get(_ISA, 1 << 62)
