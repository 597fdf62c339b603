"""reshape_and_cache_flash, merge_attn_states and merge_state_v2 on torch tensors against the
reference of torch_reference.py: cache writes bit for bit (NHD and HND views, fp8 with
per-tensor and per-head scales, -1 slots, strided key/value), merges in fp32 math."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
flashserve = pytest.importorskip("flashserve")

from helpers_torch import (DEVICES, Case, cache_storage, check_bits, check_close,  # noqa: E402
                           check_in_place, fused_views, n_cases, poisoned)
from torch_reference import FP8_MAX, merge_ref, reshape_and_cache_ref  # noqa: E402

# (kv_cache_dtype, how an fp8 cache is typed: vLLM allocates uint8 and views it as fp8)
CACHE_KINDS = [("auto", None), ("fp8", torch.uint8), ("fp8", torch.float8_e4m3fn),
               ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.uint8),
               ("fp8_e5m2", torch.float8_e5m2)]
MERGE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
MERGE_LSE_TOL = (1e-4, 1e-5)


@pytest.fixture
def case(request) -> Case:
    return Case(request)


def draw_scale(case: Case, heads_kv: int, device: str) -> torch.Tensor:
    """An fp8 cache scale: fp32 [] (vLLM's layer._k_scale), [1] or [H_kv] (per head)."""
    kind = case.rng.choice(["scalar", "one", "per_head"])
    vals = torch.rand(heads_kv if kind == "per_head" else 1, generator=case.gen) * 0.2 + 0.01
    return (vals.reshape(()) if kind == "scalar" else vals).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", CACHE_KINDS, ids=lambda k: k if isinstance(k, str) else str(k)[6:])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_reshape_and_cache_flash(case: Case, device: str, kind, layout: str, dtype) -> None:
    """New tokens land bit-exact in their slots; -1 slots and padding rows write nothing, and
    every other byte of the allocation (the views cover all of it) stays as it was."""
    kv_cache_dtype, storage = kind
    for i in range(n_cases(device, 3, 12)):
        heads, heads_kv = case.rng.choice([(4, 1), (8, 2), (6, 3), (16, 8)])
        d = case.rng.choice([64, 128, 80, 256] if device != "cpu" else [64, 128, 80])
        block_size = case.rng.choice([1, 16, 32])
        num_blocks = case.rng.randint(1, 6 if device == "cpu" else 40)
        slots_total = num_blocks * block_size
        num_tokens = case.rng.randint(0, min(slots_total, 40 if device == "cpu" else 600))
        arrangement = case.rng.choice(["separate", "stacked", "interleaved"])
        cache_dtype = dtype if storage is None else storage
        case.desc = (f"case {i}: H_kv={heads_kv} D={d} bs={block_size} blocks={num_blocks} "
                     f"tokens={num_tokens} {arrangement}/{layout} cache={cache_dtype}")
        # key/value: views of a fused qkv projection with padding rows past num_tokens.
        rows = num_tokens + case.rng.randint(0, 3)
        _, key, value = fused_views(case, rows, [(heads, d), (heads_kv, d), (heads_kv, d)], dtype,
                                    device, scale=case.rng.choice([1.0, 30.0]))
        k_cache, v_cache = cache_storage(case, num_blocks, block_size, heads_kv, d, d,
                                         cache_dtype, device, arrangement, layout)
        slots = torch.tensor(case.perm(slots_total)[:num_tokens], dtype=torch.int64)
        slots[torch.rand(num_tokens, generator=case.gen) < 0.2] = -1
        slot_mapping = slots.to(device)
        k_scale, v_scale = draw_scale(case, heads_kv, device), draw_scale(case, heads_kv, device)
        expect_k, expect_v = k_cache.clone(), v_cache.clone()
        reshape_and_cache_ref(key, value, expect_k, expect_v, slot_mapping, kv_cache_dtype,
                              k_scale, v_scale)
        res = flashserve.reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping,
                                                 kv_cache_dtype, k_scale, v_scale)
        assert res is None, "reshape_and_cache_flash returns None"
        check_bits(case, "key_cache", k_cache, expect_k)
        check_bits(case, "value_cache", v_cache, expect_v)


def random_lse(case: Case, tokens: int, heads: int, device: str) -> torch.Tensor:
    """fp32 [T, H] LSEs around 0..10 with a few empty states (-inf, and +inf as some producers
    write for "no keys")."""
    lse = torch.randn(tokens, heads, generator=case.gen) * 3 + 5
    r = torch.rand(tokens, heads, generator=case.gen)
    lse[r < 0.08] = -math.inf
    lse[(r >= 0.08) & (r < 0.12)] = math.inf
    return lse.to(device)


def merge_inputs(case: Case, device: str, dtype, strided: bool):
    tokens = case.rng.randint(0, 40 if device == "cpu" else 700)
    heads = case.rng.choice([1, 4, 8, 12, 32])
    d = case.rng.choice([64, 128, 80, 256, 512])
    if strided:
        a, b = fused_views(case, tokens, [(heads, d), (heads, d)], dtype, device)
    else:
        a = case.randn(tokens, heads, d, dtype=dtype, device=device)
        b = case.randn(tokens, heads, d, dtype=dtype, device=device)
    return a, random_lse(case, tokens, heads, device), b, random_lse(case, tokens, heads, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["no_lse", "output_lse"])
@pytest.mark.parametrize("partial", [False, True], ids=["all_rows", "prefill_tokens"])
def test_merge_attn_states(case: Case, device: str, dtype, with_lse: bool, partial: bool) -> None:
    """vLLM's merge_attn_states: LSE [H, T]; rows past prefill_tokens_with_context copy the
    suffix state."""
    for i in range(n_cases(device, 2, 8)):
        a, la, b, lb = merge_inputs(case, device, dtype, strided=case.rng.random() < 0.5)
        tokens, heads, d = a.shape
        rows = case.rng.randint(0, tokens) if partial else None
        case.desc = f"case {i}: T={tokens} H={heads} D={d} prefill_tokens_with_context={rows}"
        out = poisoned(a.shape, dtype, device)
        out_lse = poisoned((heads, tokens), torch.float32, device) if with_lse else None
        res = flashserve.merge_attn_states(out, a, la.T.contiguous(), b, lb.T.contiguous(),
                                           output_lse=out_lse, prefill_tokens_with_context=rows)
        assert res is None, "merge_attn_states returns None"
        ref_o, ref_l = merge_ref(a, la, b, lb, rows)
        check_close(case, "output", out, ref_o, *MERGE_TOL[dtype])
        if with_lse:
            check_close(case, "output_lse [H, T]", out_lse, ref_l.T, *MERGE_LSE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_merge_attn_states_fp8_output(case: Case, device: str, dtype) -> None:
    """output fp8 e4m3 with output_scale: stores clamp(x / scale, ±448), within one fp8 step of
    the rounded reference."""
    for i in range(n_cases(device, 3, 10)):
        a, la, b, lb = merge_inputs(case, device, dtype, strided=False)
        scale = torch.tensor(case.rng.choice([0.002, 0.01, 0.05]), device=device)
        case.desc = f"case {i}: T={a.shape[0]} H={a.shape[1]} D={a.shape[2]} scale={scale.item()}"
        out = poisoned(a.shape, torch.float8_e4m3fn, device)
        out_lse = poisoned((a.shape[1], a.shape[0]), torch.float32, device)
        flashserve.merge_attn_states(out, a, la.T.contiguous(), b, lb.T.contiguous(),
                                     output_lse=out_lse, output_scale=scale)
        ref_o, ref_l = merge_ref(a, la, b, lb)
        expect = (ref_o / scale.cpu().float()).clamp(-FP8_MAX[torch.float8_e4m3fn],
                                                     FP8_MAX[torch.float8_e4m3fn])
        # One e4m3 step: 1/8 of the value's binade (1/16 relative at least), 2^-9 below normals.
        check_close(case, "fp8 output (stored units)", out, expect, 2.0 ** -9, 0.125)
        check_close(case, "output_lse [H, T]", out_lse, ref_l.T, *MERGE_LSE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("given", [False, True], ids=["allocated", "given"])
def test_merge_state_v2(case: Case, device: str, dtype, given: bool) -> None:
    """SGLang's merge_state_v2: s tensors [T, H]; returns (v_merged, s_merged), written in
    place when given."""
    for i in range(n_cases(device, 2, 8)):
        a, la, b, lb = merge_inputs(case, device, dtype, strided=case.rng.random() < 0.5)
        case.desc = f"case {i}: T={a.shape[0]} H={a.shape[1]} D={a.shape[2]}"
        v_m = poisoned(a.shape, dtype, device) if given else None
        s_m = poisoned(la.shape, torch.float32, device) if given else None
        res = flashserve.merge_state_v2(a, la, b, lb, v_m, s_m)
        assert isinstance(res, tuple) and len(res) == 2, "merge_state_v2 returns (v, s)"
        out, out_lse = res
        if given:
            check_in_place(case, "v_merged", out, v_m)
            check_in_place(case, "s_merged", out_lse, s_m)
        assert out.dtype == dtype and out_lse.dtype == torch.float32
        ref_o, ref_l = merge_ref(a, la, b, lb)
        check_close(case, "v_merged", out, ref_o, *MERGE_TOL[dtype])
        check_close(case, "s_merged [T, H]", out_lse, ref_l, *MERGE_LSE_TOL)

