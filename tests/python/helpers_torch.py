"""Shared pieces of the torch tests: seeds, devices, poisoned outputs, tolerance checks, and
inputs laid out the way engines pass them (paged caches with K and V interleaved per block or
stacked, HND through a permuted view, block-table row slices, q/k/v as views of a fused
projection)."""

from __future__ import annotations

import math
import os
import random
import sys
import warnings
import zlib
from dataclasses import dataclass

import pytest
import torch

import flashserve
from torch_reference import gather_paged


def _base_seed() -> int:
    """FLASHSERVE_SEED, else the run's seed that conftest.py drew (one seed per run, printed
    in the header), else a fresh one."""
    if os.environ.get("FLASHSERVE_SEED"):
        return int(os.environ["FLASHSERVE_SEED"])
    seed = getattr(sys.modules.get("conftest"), "BASE_SEED", None)
    return seed if isinstance(seed, int) else random.SystemRandom().randrange(1 << 31)


BASE_SEED = _base_seed()
# CUDA where both torch and the package have it (a CPU-only build on a GPU machine tests the CPU).
HAS_CUDA = torch.cuda.is_available() and flashserve.WITH_CUDA
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
HALF_DTYPES = [torch.float16, torch.bfloat16]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# (atol, rtol) of attention outputs against the float reference, by output dtype.
OUT_TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}
LSE_TOL = (1e-3, 1e-4)
NAN = float("nan")


class Case:
    """The random source of one test: python Random and a CPU torch.Generator, both seeded from
    FLASHSERVE_SEED (or a fresh seed) and the test id. `where()` says how to reproduce."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % (1 << 31)
        request.node.flashserve_seed = self.seed  # conftest.py reports it on failure
        self.rng = random.Random(self.seed)
        self.gen = torch.Generator().manual_seed(self.seed)
        self.desc = ""
        self.ran = 0
        self.unsupported: list[str] = []

    def where(self) -> str:
        return f"[FLASHSERVE_SEED={BASE_SEED}, test seed {self.seed}] {self.desc}"

    def call(self, fn, *args, **kw):
        """fn(*args, **kw); None when the device does not implement the combination
        (NotImplementedError, recorded for done())."""
        try:
            res = fn(*args, **kw)
        except NotImplementedError as e:
            self.unsupported.append(f"{e} ({self.desc})")
            return None
        self.ran += 1
        return res

    def done(self) -> None:
        """At the end of a test: skip it when no case was implemented on the device, else warn
        about the cases that were not."""
        if self.unsupported and not self.ran:
            pytest.skip(f"not implemented on this device: {self.unsupported[0]}")
        if self.unsupported:
            warnings.warn(f"{len(self.unsupported)} case(s) not implemented on this device, "
                          f"first: {self.unsupported[0]}")

    def randn(self, *shape: int, dtype=torch.float32, device="cpu", scale: float = 1.0):
        x = torch.randn(*shape, generator=self.gen) * scale
        return x.to(dtype).to(device)

    def randint(self, lo: int, hi: int, shape, device="cpu") -> torch.Tensor:
        return torch.randint(lo, hi, tuple(shape), generator=self.gen).to(device)

    def perm(self, n: int) -> list[int]:
        return torch.randperm(n, generator=self.gen).tolist()


def n_cases(device: str, cpu: int, cuda: int) -> int:
    """How many random cases a test draws: few on the CPU reference, more on the GPU."""
    return cpu if device == "cpu" else cuda


def poisoned(shape, dtype: torch.dtype, device: str) -> torch.Tensor:
    """An output buffer filled with NaN: every element the call must write stays visibly NaN."""
    return torch.full(tuple(shape), NAN, dtype=dtype, device=device)


def fail(case: Case, what: str, detail: str) -> None:
    pytest.fail(f"{what}: {detail} {case.where()}", pytrace=False)


def check_close(case: Case, what: str, actual: torch.Tensor, ref: torch.Tensor,
                atol: float, rtol: float) -> None:
    """actual within atol + rtol * |ref| of ref; NaN nowhere, infinities at the same places."""
    if tuple(actual.shape) != tuple(ref.shape):
        fail(case, what, f"shape {tuple(actual.shape)}, expected {tuple(ref.shape)}")
    a, r = actual.detach().float().cpu(), ref.detach().float().cpu()
    nan = torch.isnan(a) & ~torch.isnan(r)
    if nan.any():
        idx = tuple(torch.nonzero(nan)[0].tolist())
        fail(case, what, f"{int(nan.sum())} NaN (unwritten or invalid) elements, first at {idx}")
    inf_mismatch = (torch.isinf(a) | torch.isinf(r)) & (a != r)
    if inf_mismatch.any():
        idx = tuple(torch.nonzero(inf_mismatch)[0].tolist())
        fail(case, what, f"infinity mismatch at {idx}: got {a[idx].item()}, expected {r[idx].item()}")
    fin = torch.isfinite(r)
    err = (a - r).abs().masked_fill(~fin, 0.0)
    bad = err > atol + rtol * r.abs().masked_fill(~fin, 0.0)
    if bad.any():
        idx = tuple(torch.nonzero(bad)[0].tolist())
        fail(case, what, f"{int(bad.sum())}/{a.numel()} elements off (max err {err.max().item():.3g}, "
             f"atol {atol:.3g} rtol {rtol:.3g}); first at {idx}: got {a[idx].item()}, "
             f"expected {r[idx].item()}")


def check_out(case: Case, what: str, actual: torch.Tensor, ref: torch.Tensor,
              max_len: int = 0) -> None:
    """An attention output against the float reference, with the tolerance of its dtype,
    widened by sqrt of the accumulation length past 512 keys."""
    atol, rtol = OUT_TOL[actual.dtype]
    widen = max(1.0, math.sqrt(max_len / 512))
    check_close(case, what, actual, ref, atol * widen, rtol * widen)


def check_out_fp8_qkv(case: Case, what: str, actual: torch.Tensor, ref: torch.Tensor, values,
                      max_len: int) -> None:
    """check_out for q, k and v all e4m3. On a GPU the fp8 prefill kernel rounds P to e4m3, as
    FlashAttention-3's fp8 forward does (each weight within 2^-4 relative, the subnormal tail
    within 2^-18 of the row's largest), so out is within (2^-4 + keys 2^-18) max|v| of the exact
    weighted average (the C++ tests' model: fsgpu::fp8_p_round), past the dtype's tolerance; the
    CPU reference is exact. values: the dequantized value rows the reference used."""
    if not actual.is_cuda:
        return check_out(case, what, actual, ref, max_len)
    v_max = max((float(v.abs().max()) for v in values if v.numel()), default=0.0)
    atol, rtol = OUT_TOL[actual.dtype]
    widen = max(1.0, math.sqrt(max_len / 512))
    p_round = 2.0 ** -4 + max_len * 2.0 ** -18
    check_close(case, what, actual, ref, atol * widen + p_round * v_max, rtol * widen)


def check_lse(case: Case, what: str, actual: torch.Tensor, ref: torch.Tensor) -> None:
    if actual.dtype != torch.float32:
        fail(case, what, f"dtype {actual.dtype}, expected torch.float32")
    check_close(case, what, actual, ref, *LSE_TOL)


def check_bits(case: Case, what: str, actual: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-exact equality (any dtype), reporting the first differing element."""
    a = actual.detach().cpu().contiguous().view(torch.uint8)
    r = ref.detach().cpu().contiguous().view(torch.uint8)
    if a.shape != r.shape:
        fail(case, what, f"byte shape {tuple(a.shape)}, expected {tuple(r.shape)}")
    diff = a != r
    if diff.any():
        idx = tuple(torch.nonzero(diff)[0].tolist())
        fail(case, what, f"{int(diff.sum())} bytes differ, first at byte index {idx}: "
             f"got {a[idx].item():#04x}, expected {r[idx].item():#04x}")


def check_in_place(case: Case, what: str, returned: torch.Tensor, out: torch.Tensor) -> None:
    """The call wrote into out= and returned that tensor (same storage, shape and strides)."""
    if returned is out:
        return
    same = (returned.data_ptr() == out.data_ptr() and returned.shape == out.shape
            and returned.stride() == out.stride())
    if not same:
        fail(case, what, "out= was not returned (a different tensor came back)")


def fused_views(case: Case, rows: int, widths: list[tuple[int, int]], dtype, device,
                scale: float = 1.0, pad: int = 8) -> list[torch.Tensor]:
    """Tensors [rows, H_i, D_i] as views of one fused projection [rows, sum + pad] (the token
    stride exceeds each row), filled with N(0, scale)."""
    total = sum(h * d for h, d in widths) + pad
    base = case.randn(rows, total, dtype=dtype, device=device, scale=scale)
    out, col = [], 0
    for h, d in widths:
        out.append(base[:, col:col + h * d].view(rows, h, d))
        col += h * d
    return out


def strided_like(case: Case, x: torch.Tensor, pad: int = 16) -> torch.Tensor:
    """A copy of x [..., H, D] whose last two dims sit inside wider rows (non-contiguous)."""
    *lead, h, d = x.shape
    base = case.randn(*lead, h * d + pad, dtype=x.dtype, device=x.device)
    view = base[..., :h * d].view(*lead, h, d)
    view.copy_(x)
    return view


def seq_lens(case: Case, batch: int, hi: int, lo: int = 0) -> list[int]:
    """Random lengths in [lo, hi], with the edge lengths (lo, 1, hi) likely."""
    edges = [lo, min(max(1, lo), hi), hi]
    return [case.rng.choice(edges) if case.rng.random() < 0.4 else case.rng.randint(lo, hi)
            for _ in range(batch)]


def cu_seqlens(lens: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


@dataclass
class PagedKv:
    """A paged KV cache as an engine holds it, with the sequences it stores."""
    k_cache: torch.Tensor      # [num_blocks, block_size, H_kv, D] view
    v_cache: torch.Tensor      # [num_blocks, block_size, H_kv, Dv] view
    block_table: torch.Tensor  # int32 [B, max_blocks], a column slice of a wider table
    lens: list[int]
    blocks: list[torch.Tensor]  # block ids of each sequence

    def keys(self, descale: torch.Tensor | None = None) -> list[torch.Tensor]:
        return self._rows(self.k_cache, descale)

    def values(self, descale: torch.Tensor | None = None) -> list[torch.Tensor]:
        return self._rows(self.v_cache, descale)

    def _rows(self, cache, descale) -> list[torch.Tensor]:
        return [gather_paged(cache, self.blocks[b], n, None if descale is None else descale[b])
                for b, n in enumerate(self.lens)]


def cache_storage(case: Case, num_blocks: int, block_size: int, heads_kv: int, d: int, dv: int,
                  dtype, device, arrangement: str, layout: str):
    """(k_cache, v_cache): views [num_blocks, block_size, H_kv, D] of one allocation, filled
    with random values (random bytes when dtype is uint8).

    arrangement: "separate" (two tensors), "stacked" ([2, num_blocks, ...]) or "interleaved"
    ([num_blocks, 2, ...], K and V of a block adjacent). layout "hnd" stores [.., H_kv,
    block_size, D] and exposes it through a permuted view, as engines do."""
    if d != dv:
        arrangement = "separate"
    inner = (heads_kv, block_size) if layout == "hnd" else (block_size, heads_kv)

    def fill(*shape):
        if dtype == torch.uint8:  # raw bytes, as an fp8 cache that held other tokens
            return torch.randint(0, 256, shape, generator=case.gen, dtype=torch.uint8).to(device)
        x = torch.randn(*shape, generator=case.gen) * (4.0 if dtype in FP8 else 1.0)
        return x.to(dtype).to(device)

    def to_nhd(t):
        return t.transpose(1, 2) if layout == "hnd" else t

    if arrangement == "separate":
        return to_nhd(fill(num_blocks, *inner, d)), to_nhd(fill(num_blocks, *inner, dv))
    if arrangement == "stacked":
        base = fill(2, num_blocks, *inner, d)
        return to_nhd(base[0]), to_nhd(base[1])
    base = fill(num_blocks, 2, *inner, d)
    return to_nhd(base[:, 0]), to_nhd(base[:, 1])


def make_paged_kv(case: Case, lens: list[int], heads_kv: int, d: int, dv: int, block_size: int,
                  dtype, device, arrangement: str = "separate", layout: str = "nhd",
                  extra_cols: int = 0) -> PagedKv:
    """Sequences of `lens` tokens in random blocks of a paged cache. Blocks no sequence owns
    hold NaN (a read of them shows); unused block-table entries point at a finite null block."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 1 + case.rng.randint(1, 3)
    k_cache, v_cache = cache_storage(case, num_blocks, block_size, heads_kv, d, dv, dtype,
                                        device, arrangement, layout)
    ids = case.perm(num_blocks)
    null_block, ids = ids[0], ids[1:]
    owned, blocks = 0, []
    for n in need:
        blocks.append(torch.tensor(ids[owned:owned + n], dtype=torch.int32, device=device))
        owned += n
    for blk in ids[owned:]:
        k_cache[blk] = NAN
        v_cache[blk] = NAN
    width = max([1, *need]) + extra_cols
    col0 = case.rng.randint(0, 2)
    wide = torch.full((len(lens), width + col0 + 3), null_block, dtype=torch.int32, device=device)
    for b, blk in enumerate(blocks):
        wide[b, col0:col0 + len(blk)] = blk
    return PagedKv(k_cache, v_cache, wide[:, col0:col0 + width], list(lens), blocks)


def fp8_descale(case: Case, batch: int, heads_kv: int, device, broadcast: bool) -> torch.Tensor:
    """Descales [B, H_kv] fp32: per (sequence, head), or one value expanded with stride 0."""
    if broadcast:
        return torch.tensor([case.rng.uniform(0.1, 0.5)], device=device).expand(batch, heads_kv)
    return (torch.rand(batch, heads_kv, generator=case.gen) * 0.4 + 0.1).to(device)


class _EagerReplay:
    """The CPU stand-in for a CUDA graph: replay() runs the call again."""

    def __init__(self, fn) -> None:
        self.replay = fn


def capture(fn, device: str = "cuda", warmup: int = 2):
    """A CUDA graph of fn() after `warmup` calls on a side stream (as engines capture); on the
    CPU an eager re-run over the same static buffers."""
    if device == "cpu":
        return _EagerReplay(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph

