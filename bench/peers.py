"""Peer timings through torch for bench/driver.py, and the header (device, clocks, versions,
re-measured ceilings).

Peers: "cudnn" and "fa2" are torch.nn.functional.scaled_dot_product_attention restricted with
sdpa_kernel to CUDNN_ATTENTION and FLASH_ATTENTION; "flex" is torch.compile'd flex_attention on
contiguous tensors; "flex_paged" is flex_attention over a physical page pool with a block mask
converted from the logical one (torch.nn.attention.experimental._paged_attention); "fa4" is
FlashAttention-4 (flash_attn.cute, CuTe DSL; optional: fa4_status() says whether it imports), varlen
THD prefill and paged decode through page_table. SDPA and flex tensors are BHSD contiguous; decode KV is contiguous GQA [B, H_kv, L, D] with enable_gqa=True
(or repeated to H heads where a backend refuses GQA: the row says which).

Timing: CUDA events around each call after warm-up, median of >= min_iters runs; the GPU is kept
busy (torch.cuda._sleep) while the timed calls are queued, so host overhead stays out of the
times; input sets rotate (at least 2, together more than 3x the L2). Every failure becomes a row
with the error; nothing here raises to the driver.
"""
from __future__ import annotations

import math
import os
import statistics
import subprocess
import time
import warnings

import torch
import torch.nn.functional as F

_CLOCK_HZ = 2.0e9       # to turn a sleep time into torch.cuda._sleep cycles (an upper bound)
_context_lost = False   # set after a CUDA error that poisons the context


# ---------------------------------------------------------------- timing

def _event_time(fn, arg) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(arg)
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def time_gpu(fn, nsets: int, min_iters: int = 20, max_iters: int = 100, warmup: int = 3,
             target_s: float = 0.5, row_budget_s: float = 6.0) -> dict:
    """Median of per-call event times of fn(set) over rotating sets."""
    max_iters = max(max_iters, min_iters)
    fn(0)
    torch.cuda.synchronize()
    est = _event_time(fn, 1 % nsets)
    note = ""
    slow = est * min_iters > row_budget_s * 1e3
    host = []
    for i in range(1, 1 if slow else warmup):
        t = time.perf_counter()
        fn(i % nsets)
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    iters = min(max(math.ceil(target_s * 1e3 / max(est, 1e-3)), min_iters), max_iters)
    if slow:
        iters = max(3, int(row_budget_s * 1e3 / est))
        note = f"{iters} runs, fewer than {min_iters}: one run takes {est:.1f} ms"
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    per_call = max(host) if host else 1e-3
    sleep_s = min(iters * per_call * 1.5 + 5e-4, 0.2)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(sleep_s * _CLOCK_HZ))
    for i, (a, b) in enumerate(events):
        a.record()
        fn(i % nsets)
        b.record()
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in events)
    return {"time_ms": statistics.median(ms), "time_min_ms": ms[0], "time_max_ms": ms[-1], "runs": iters,
            "note": note}


def choose_sets(set_bytes: int) -> int:
    """At least 2 input sets, together more than 3x the L2, within 60% of free memory."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    free, _ = torch.cuda.mem_get_info()
    want = max(2, math.ceil(3 * l2 / max(set_bytes, 1)))
    return max(1, min(want, 64, int(0.6 * free) // max(set_bytes, 1)))


def release_memory() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- header

def gpu_clocks() -> dict:
    """nvidia-smi's view of the card now (clocks in MHz)."""
    fields = ("name", "driver_version", "pstate", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "temperature.gpu", "power.draw", "power.limit")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        return dict(zip(fields, (v.strip() for v in out[0].split(",")))) if out else {}
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}


def measure_header(min_iters: int = 20) -> dict:
    """Device, versions, clocks, and the two ceilings measured now."""
    props = torch.cuda.get_device_properties(0)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    header = {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
              "l2_mb": getattr(props, "L2_cache_size", 0) / 2**20, "memory_gb": props.total_memory / 1e9,
              "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
              "triton": triton_version, "clocks_start": gpu_clocks()}

    copy = _copy_ceiling(min_iters)
    gemm = _gemm_ceiling(min_iters)
    header["clocks_after_gemm"] = gpu_clocks()
    release_memory()
    header["ceilings"] = copy | gemm
    return header


def _copy_ceiling(min_iters: int) -> dict:
    """Device-to-device copy of 2 GiB of bf16: bytes read + written over the median time."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_gpu(lambda _: dst.copy_(src), 1, min_iters=min_iters, target_s=0.2)
    moved = 2 * src.numel() * src.element_size()
    return {"copy_gbps": moved / (t["time_ms"] * 1e-3) / 1e9, "copy_ms": t["time_ms"], "copy_runs": t["runs"],
            "copy_bytes": moved}


def _gemm_ceiling(min_iters: int, m: int = 8192) -> dict:
    """bf16 m x m x m matrix product on random data: 2 m^3 FLOP over the median time."""
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = time_gpu(lambda _: torch.mm(a, b), 1, min_iters=min_iters, target_s=0.3)
    return {"gemm_tflops": 2.0 * m**3 / (t["time_ms"] * 1e-3) / 1e12, "gemm_ms": t["time_ms"],
            "gemm_runs": t["runs"], "gemm_shape": [m, m, m]}


# ---------------------------------------------------------------- inputs

def _randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def prefill_sets(c):
    """[(q, k, v)] BHSD contiguous."""
    set_bytes = 2 * c.B * c.S * (2 * c.H + 2 * c.Hkv) * c.D
    return [(_randn(c.B, c.H, c.S, c.D), _randn(c.B, c.Hkv, c.S, c.D), _randn(c.B, c.Hkv, c.S, c.D))
            for _ in range(choose_sets(set_bytes))]


def decode_sets(c):
    """[(q [B, H, 1, D], k, v [B, H_kv, L, D])]: contiguous GQA KV."""
    set_bytes = c.kv_bytes + 4 * c.B * c.H * c.D
    return [(_randn(c.B, c.H, 1, c.D), _randn(c.B, c.Hkv, c.L, c.D), _randn(c.B, c.Hkv, c.L, c.D))
            for _ in range(choose_sets(set_bytes))]


# ---------------------------------------------------------------- SDPA peers

def _first_call_error(fn) -> str | None:
    """Runs fn once; None if it works, else the error with the backend's warnings (its reasons)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
            torch.cuda.synchronize()
            return None
        except RuntimeError as e:
            why = "; ".join(str(w.message).splitlines()[0][:200] for w in caught[:3])
            return (str(e).splitlines() or ["RuntimeError"])[0][:200] + (f" ({why})" if why else "")


def _sdpa(backend_name: str, c, min_iters: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)
    sets = prefill_sets(c) if c.op == "prefill" else decode_sets(c)
    gqa = c.H != c.Hkv
    row = {"kernel": f"sdpa:{backend_name}", "layout": "BHSD contiguous"}

    def call(i, kw):
        q, k, v = sets[i]
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=c.causal, **kw)

    kw = {"enable_gqa": True} if gqa else {}
    err = _first_call_error(lambda: call(0, kw))
    if err and not gqa:
        raise RuntimeError(err)
    if gqa:
        row["gqa"] = "enable_gqa"
    if err:  # the backend refuses GQA: repeat the KV heads (it then reads H/H_kv times the KV bytes)
        sets = [(q, k.repeat_interleave(c.H // c.Hkv, dim=1), v.repeat_interleave(c.H // c.Hkv, dim=1))
                for q, k, v in sets]
        kw = {}
        err2 = _first_call_error(lambda: call(0, kw))
        if err2:
            raise RuntimeError(f"{err2}; with enable_gqa: {err}")
        row["gqa"] = "repeat_kv"
        row["note"] = f"enable_gqa refused ({err}); KV repeated to H heads, figure counts the H_kv bytes"
    t = time_gpu(lambda i: call(i, kw), len(sets), min_iters=min_iters)
    note = "; ".join(x for x in (row.pop("note", ""), t.pop("note")) if x)
    return row | t | {"sets": len(sets)} | ({"note": note} if note else {})


# ---------------------------------------------------------------- FlexAttention peers

_flex_fn = None


def _flex():
    """torch.compile'd flex_attention, static shapes, with room for one compile per shape."""
    global _flex_fn
    if _flex_fn is None:
        from torch.nn.attention.flex_attention import flex_attention
        import torch._dynamo
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 512)
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 4096)
        _flex_fn = torch.compile(flex_attention, dynamic=False)
    return _flex_fn


def _first_working(attempts, run):
    """Runs run(options) for each options dict until one works; returns (options, errors)."""
    errors = []
    for opts in attempts:
        try:
            run(opts)
            return opts, errors
        except Exception as e:  # noqa: BLE001 -- a compile or launch failure of one option set
            errors.append(f"{opts or 'default'}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    return None, errors


def _flex_contiguous(c, min_iters: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask
    flex = _flex()
    sets = prefill_sets(c) if c.op == "prefill" else decode_sets(c)
    mask = None
    if c.causal:
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, c.S, c.S, device="cuda")
    gqa = c.H != c.Hkv
    attempts = [{}]
    if c.D > 128:
        attempts.append({"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1})

    def call(i, opts):
        q, k, v = sets[i]
        return flex(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=opts or None)

    opts, errors = _first_working(attempts, lambda o: (call(0, o), torch.cuda.synchronize()))
    if opts is None:
        return {"status": "error", "kernel": "flex_attention (compiled)", "error": "; ".join(errors)}
    t = time_gpu(lambda i: call(i, opts), len(sets), min_iters=min_iters)
    note = "; ".join(x for x in (f"kernel_options {opts}" if opts else "", "; ".join(errors), t.pop("note")) if x)
    layout = "contiguous KV" if c.op == "decode" else "contiguous"
    return {"kernel": "flex_attention (compiled)", "layout": layout, "sets": len(sets),
            "gqa": "enable_gqa" if gqa else None, **t} | ({"note": note} if note else {})


def _paged_masks(c, nsets, page):
    """Page pool, per-set block masks sharing one mask_mod, and the shuffled page tables."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
    per = -(-c.L // page)
    pool = nsets * c.B * per
    pa = PagedAttention(pool, page, c.B, device="cuda")
    perm = torch.randperm(pool, device="cuda").view(nsets, c.B, per)
    logical_idx = torch.arange(per, device="cuda").expand(c.B, per)
    for i in range(nsets):  # one physical->logical table serves every set: their pages are disjoint
        pa.physical_to_logical.scatter_(1, perm[i], logical_idx)
    pa.capacity.fill_(per * page)
    logical = create_block_mask(lambda b, h, q, kv: kv < c.L, c.B, None, 1, c.L, device="cuda",
                                BLOCK_SIZE=(128, page))
    masks, mask_mod = [], None
    for i in range(nsets):
        pa.page_table[:, :per] = perm[i]
        m = pa.convert_logical_block_mask(logical)
        if mask_mod is None:
            mask_mod = m.mask_mod
        else:  # the same mask_mod object for every set, so no recompile per set (where the API allows)
            try:
                m = BlockMask.from_kv_blocks(m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks,
                                             m.full_kv_indices, BLOCK_SIZE=m.BLOCK_SIZE, mask_mod=mask_mod,
                                             seq_lengths=m.seq_lengths)
            except (TypeError, AttributeError):
                pass
        masks.append(m)
    return pool, masks


def _flex_paged(c, min_iters: int) -> dict:
    """Decode over a paged pool [1, H_kv, pages * page, D] through a converted block mask."""
    if c.op != "decode":
        return {"status": "infeasible", "error": "flex_paged is a decode formulation"}
    if c.block < 16:
        return {"status": "infeasible", "kernel": "flex_attention (compiled)",
                "error": f"block {c.block}: the paged formulation needs the block mask's KV block "
                         "size to equal the page size, and flex kernels need >= 16"}
    flex = _flex()
    set_bytes = c.kv_bytes + 4 * c.B * c.H * c.D
    nsets = choose_sets(set_bytes)
    pool, masks = _paged_masks(c, nsets, c.block)
    kc = _randn(1, c.Hkv, pool * c.block, c.D)
    vc = _randn(1, c.Hkv, pool * c.block, c.D)
    qs = [_randn(c.B, c.H, 1, c.D) for _ in range(nsets)]
    attempts = [{"BLOCK_N": c.block}, {}] if c.block < 64 else [{}]

    def call(i, opts):
        return flex(qs[i], kc, vc, block_mask=masks[i], enable_gqa=c.H != c.Hkv, kernel_options=opts or None)

    opts, errors = _first_working(attempts, lambda o: (call(0, o), torch.cuda.synchronize()))
    if opts is None:
        return {"status": "error", "kernel": "flex_attention (compiled)", "error": "; ".join(errors),
                "note": "paged formulation failed; the flex row is the contiguous-KV formulation"}
    t = time_gpu(lambda i: call(i, opts), nsets, min_iters=min_iters)
    note = "; ".join(x for x in (f"kernel_options {opts}" if opts else "", "; ".join(errors), t.pop("note")) if x)
    return {"kernel": "flex_attention (compiled)", "layout": f"paged: pool of {pool} pages of {c.block}, "
            "shuffled, block mask converted by PagedAttention", "sets": nsets, "gqa": "enable_gqa", **t} | (
        {"note": note} if note else {})


# ---------------------------------------------------------------- FlashAttention-4 peer

_fa4_import = None   # (flash_attn_varlen_func or None, status dict), filled by fa4_status()


def fa4_status() -> dict:
    """Imports flash_attn.cute once: {"available": bool, "version", "cutlass_dsl", "error"}. The
    package is optional (carried as wheels, tools/carry-fa4); its absence is not an error."""
    global _fa4_import
    if _fa4_import is None:
        st = {"available": False}
        try:
            from flash_attn.cute import flash_attn_varlen_func
            st["available"] = True
            from importlib.metadata import PackageNotFoundError, version
            for key, dist in (("version", "flash-attn-4"), ("cutlass_dsl", "nvidia-cutlass-dsl")):
                try:
                    st[key] = version(dist)
                except PackageNotFoundError:
                    st[key] = None
            _fa4_import = (flash_attn_varlen_func, st)
        except Exception as e:  # noqa: BLE001 -- ImportError, or the DSL failing to load its libraries
            st["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            _fa4_import = (None, st)
    return dict(_fa4_import[1])


def _fa4_first_call(fn) -> float:
    """The first call of a shape JIT-compiles (or loads the compiled kernel from
    FLASH_ATTENTION_CUTE_DSL_CACHE_DIR): done and timed here, outside the timed runs."""
    t = time.perf_counter()
    fn(0)
    torch.cuda.synchronize()
    return round(time.perf_counter() - t, 2)


def _fa4_func():
    if fa4_status()["available"]:
        return _fa4_import[0]
    raise RuntimeError(f"flash_attn.cute absent: {_fa4_import[1].get('error')}")


def _fa4_mod_kwargs(c) -> dict:
    """The score modifier of a prefill_mods row as FA4 arguments (the same parameters as
    attn_bench: sinks f32 [H] in [-2, 2), soft-cap 30, left window W (W, 0) causal / (W, W) not)."""
    if c.mod == "":
        return {}
    if c.mod == "sinks":
        return {"learnable_sink": torch.rand(c.H, device="cuda", dtype=torch.float32) * 4 - 2}
    if c.mod == "softcap":
        return {"softcap": 30.0}
    if c.mod == "window":
        return {"window_size": (c.W, 0 if c.causal else c.W)}
    raise ValueError(f"mod {c.mod}: FA4 has no such argument")


def _fa4_prefill(c, min_iters: int) -> dict:
    """Varlen THD: q [B*S, H, D], k, v [B*S, H_kv, D], cu_seqlens of B equal sequences."""
    fn = _fa4_func()
    if c.mod not in FA4_MODS:
        return {"status": "unsupported", "kernel": "fa4", "error": f"mod {c.mod}: no FA4 argument for it"}
    set_bytes = 2 * c.B * c.S * (2 * c.H + 2 * c.Hkv) * c.D
    sets = [(_randn(c.B * c.S, c.H, c.D), _randn(c.B * c.S, c.Hkv, c.D), _randn(c.B * c.S, c.Hkv, c.D))
            for _ in range(choose_sets(set_bytes))]
    cu = torch.arange(0, (c.B + 1) * c.S, c.S, device="cuda", dtype=torch.int32)
    kw = _fa4_mod_kwargs(c)

    def call(i):
        q, k, v = sets[i]
        return fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=c.S, max_seqlen_k=c.S,
                  causal=c.causal, **kw)

    jit_s = _fa4_first_call(call)
    t = time_gpu(call, len(sets), min_iters=min_iters)
    note = t.pop("note")
    mod = {"sinks": ", learnable_sink f32 [H]", "softcap": ", softcap 30",
           "window": f", window_size {kw.get('window_size')}"}.get(c.mod, "")
    return {"kernel": "fa4 flash_attn_varlen_func", "layout": f"varlen THD, cu_seqlens{mod}", "sets": len(sets),
            "first_call_s": jit_s, **t} | ({"note": note} if note else {})


def _fa4_decode(c, min_iters: int) -> dict:
    """Paged decode: q [B, 1, H, D] over one pool k, v [pages, block, H_kv, D] for all sets,
    page_table [B, L/block] int32 a shuffled permutation of the pool per set, seqused_k = L."""
    fn = _fa4_func()
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    unsplit = major == 9 and 2 * c.B * c.Hkv < sms
    if unsplit and os.environ.get("FLASHSERVE_FA4_TIME_UNSPLIT") != "1":
        # SM90 FA4 asserts num_splits == 1 ("SplitKV not supported on SM 9.0"): a decode gets one
        # CTA per (sequence, KV head) (pack_gqa), so B = 1 reads a long context on H_kv SMs.
        return {"status": "unsupported", "kernel": "fa4",
                "error": f"no split-KV on SM {major}.{minor}: B*H_kv = {c.B * c.Hkv} CTAs for {sms} SMs "
                         "(FLASHSERVE_FA4_TIME_UNSPLIT=1 times it anyway)"}
    per = -(-c.L // c.block)
    nsets = choose_sets(c.kv_bytes + 4 * c.B * c.H * c.D)
    pool = nsets * c.B * per
    kc = _randn(pool, c.block, c.Hkv, c.D)
    vc = _randn(pool, c.block, c.Hkv, c.D)
    tables = torch.randperm(pool, device="cuda").to(torch.int32).view(nsets, c.B, per)
    tables = [tables[i].contiguous() for i in range(nsets)]
    qs = [_randn(c.B, 1, c.H, c.D) for _ in range(nsets)]
    used = torch.full((c.B,), c.L, device="cuda", dtype=torch.int32)

    def call(i):
        return fn(qs[i], kc, vc, seqused_k=used, page_table=tables[i], max_seqlen_q=1, max_seqlen_k=c.L)

    jit_s = _fa4_first_call(call)
    t = time_gpu(call, nsets, min_iters=min_iters)
    note = "; ".join(x for x in (t.pop("note"), "unsplit: no split-KV on SM90, B*H_kv CTAs" if unsplit else "")
                     if x)
    return {"kernel": "fa4 flash_attn_varlen_func", "layout": f"paged: pool of {pool} pages of {c.block}, "
            "shuffled, page_table + seqused_k", "sets": nsets, "gqa": "native (pack_gqa)", "first_call_s": jit_s,
            **t} | (
        {"note": note} if note else {})


FA4_MODS = ("", "sinks", "softcap", "window")   # prefill modifiers FA4 takes as arguments


def _fa4(c, min_iters: int) -> dict:
    if c.kv != "bf16":
        return {"status": "unsupported", "kernel": "fa4", "error": "FA4's fp8 forward is SM100 only"}
    if c.op == "prefill":
        return _fa4_prefill(c, min_iters)
    if c.op == "decode":
        return _fa4_decode(c, min_iters)
    return {"status": "unsupported", "kernel": "fa4", "error": f"op {c.op}"}


# ---------------------------------------------------------------- entry

_RUNNERS = {
    "cudnn": lambda c, n: _sdpa("CUDNN_ATTENTION", c, n),
    "fa2": lambda c, n: _sdpa("FLASH_ATTENTION", c, n),
    "flex": _flex_contiguous,
    "flex_paged": _flex_paged,
    "fa4": _fa4,
}


def run_peer(peer: str, c, min_iters: int = 20) -> dict:
    """One row: {config, peer, status, time_ms, ...} or the error; never raises."""
    global _context_lost
    row = {"config": c.name, "peer": peer}
    if _context_lost:
        return row | {"status": "skipped", "error": "CUDA context lost earlier in this run"}
    try:
        r = _RUNNERS[peer](c, min_iters)
        row.update({k: v for k, v in r.items() if v is not None})
        row.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 -- every failure becomes the row's error
        msg = f"{type(e).__name__}: {str(e).strip()[:400]}"
        row.update(status="error", error=msg)
        if peer == "fa4" and isinstance(e, (AssertionError, NotImplementedError)) and "not supported" in msg:
            row["status"] = "unsupported"  # FA4's own capability checks (e.g. SplitKV on SM 9.0)
        if "CUDA error" in msg or "illegal" in msg.lower() or "AcceleratorError" in msg:
            _context_lost = True
    finally:
        try:
            release_memory()
        except Exception as e:  # noqa: BLE001
            _context_lost = True
            row.setdefault("error", f"after the row: {e}")
    return row
