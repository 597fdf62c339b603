"""flashserve inside torch's graph machinery: torch.library.opcheck of the custom ops,
torch.compile(fullgraph=True) of a decode step calling the drop-ins, and CUDA-graph capture of
flash_attn_with_kvcache / flash_attn_varlen_func decode replayed over changing lengths and block
tables. Everything also runs on the CPU: compile with the aot_eager backend, and the replay
test re-running the call eagerly over its static buffers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
flashserve = pytest.importorskip("flashserve")

from helpers_torch import (DEVICES, Case, capture, check_bits, check_out, cu_seqlens,  # noqa: E402
                           make_paged_kv, seq_lens)
from torch_reference import batched_ref, gather_paged  # noqa: E402

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


@pytest.fixture
def case(request) -> Case:
    return Case(request)


def op(name: str):
    ns = getattr(torch.ops, "flashserve", None)
    packet = getattr(ns, name, None) if ns is not None else None
    if packet is None:
        pytest.fail(f"torch.ops.flashserve.{name} is not registered", pytrace=False)
    return packet.default


def schema_args(overload, given: dict) -> tuple:
    """The positional arguments of an op from its schema: named values from `given`, defaults
    for the rest; an argument with neither fails, naming it."""
    args = []
    for a in overload._schema.arguments:
        if a.name in given:
            args.append(given[a.name])
        elif a.has_default_value():
            args.append(a.default_value)
        else:
            pytest.fail(f"{overload._schema.name}: no test value for argument {a.name!r}",
                        pytrace=False)
    return tuple(args)


def decode_batch(case: Case, device: str, batch: int, cap: int, block_size: int = 16,
                 dtype=torch.bfloat16, heads_kv: int = 2, d: int = 128):
    """A paged cache holding `batch` sequences of at most cap - 1 tokens, each with a slot
    for one more; the block table is ceil(cap / block_size) wide."""
    lens = seq_lens(case, batch, cap - 1)
    width = -(-cap // block_size)
    kv = make_paged_kv(case, [n + 1 for n in lens], heads_kv, d, d, block_size, dtype, device,
                       case.rng.choice(["separate", "interleaved"]), case.rng.choice(["nhd", "hnd"]),
                       extra_cols=width - max(-(-(n + 1) // block_size) for n in lens))
    slots = [int(kv.blocks[b][n // block_size]) * block_size + n % block_size
             for b, n in enumerate(lens)]
    return lens, slots, kv


def opcheck_args(case: Case, name: str, device: str) -> list[dict]:
    """Argument sets (by schema name) for each custom op: every mutated output and optional
    input in use at least once."""
    bf16, t, h, d = torch.bfloat16, 7, 4, 64
    if name == "reshape_and_cache_flash":
        key, value = (case.randn(5, 2, d, dtype=bf16, device=device) for _ in range(2))
        slots = torch.tensor([3, -1, 17, 40, 63], dtype=torch.int64, device=device)
        scale = torch.tensor(0.05, device=device)
        # fp8 caches typed uint8, as vLLM allocates them (opcheck's schema check cannot
        # compare float8 tensors on the CPU).
        return [dict(key=key, value=value, slot_mapping=slots, kv_cache_dtype=kv_dtype,
                     key_cache=torch.zeros(4, 16, 2, d, dtype=dt, device=device),
                     value_cache=torch.zeros(4, 16, 2, d, dtype=dt, device=device),
                     k_scale=scale, v_scale=scale)
                for kv_dtype, dt in (("auto", bf16), ("fp8", torch.uint8))]
    if name in ("merge_attn_states", "merge_state_v2"):
        a, b = (case.randn(t, h, d, dtype=torch.float16, device=device) for _ in range(2))
        lse_shape = (h, t) if name == "merge_attn_states" else (t, h)
        la, lb = (case.randn(*lse_shape, device=device) for _ in range(2))
        out = torch.empty(t, h, d, dtype=torch.float16, device=device)
        out_lse = torch.empty(*lse_shape, device=device)
        if name == "merge_state_v2":
            return [dict(v_a=a, s_a=la, v_b=b, s_b=lb, v_merged=out, s_merged=out_lse)]
        common = dict(output=out, prefix_output=a, prefix_lse=la, suffix_output=b, suffix_lse=lb,
                      prefill_tokens_with_context=None, output_scale=None)
        return [dict(common, output_lse=out_lse),
                dict(common, output_lse=None, prefill_tokens_with_context=5)]
    q_lens, k_lens = [3, 1, 0, 5], [4, 9, 2, 5]
    kv = make_paged_kv(case, k_lens, 2, d, d, 16, bf16, device, "interleaved", "hnd")
    common = dict(causal=True, softmax_scale=0.125, num_splits=0, k_cache=kv.k_cache,
                  v_cache=kv.v_cache, block_table=kv.block_table)
    if name == "kvcache_fwd":
        q = case.randn(len(k_lens), 2, h, d, dtype=bf16, device=device)
        return [dict(common, q=q, out=torch.empty_like(q), softmax_lse=torch.empty(4, h, 2, device=device),
                     cache_seqlens=torch.tensor(k_lens, dtype=torch.int32, device=device))]
    q = case.randn(sum(q_lens), h, d, dtype=bf16, device=device)
    common.update(q=q, cu_seqlens_q=cu_seqlens(q_lens, device), max_seqlen_q=max(q_lens),
                  max_seqlen_k=max(k_lens), out=torch.empty_like(q),
                  softmax_lse=torch.empty(h, q.shape[0], device=device))
    paged = dict(common, k=kv.k_cache, v=kv.v_cache,
                 seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device))
    contiguous = dict(common, k=case.randn(sum(k_lens), 2, d, dtype=bf16, device=device),
                      v=case.randn(sum(k_lens), 2, d, dtype=bf16, device=device),
                      cu_seqlens_k=cu_seqlens(k_lens, device), block_table=None)
    return [paged, contiguous]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["reshape_and_cache_flash", "merge_attn_states", "merge_state_v2",
                                  "varlen_fwd", "kvcache_fwd"])
def test_opcheck(case: Case, device: str, name: str) -> None:
    """torch.library.opcheck of torch.ops.flashserve.<name>: schema (aliasing of the `Tensor!`
    outputs), fake tensor, autograd registration, AOT dispatch with dynamic shapes."""
    overload = op(name)
    for given in opcheck_args(case, name, device):
        torch.library.opcheck(overload, schema_args(overload, given), test_utils=OPCHECK_TESTS)


def decode_step(q, k_new, v_new, k_cache, v_cache, slot_mapping, cu_q, seqused_k, block_table,
                scale, max_seqlen_k: int):
    """One engine decode step: write the new token's K/V, attend over the paged cache (varlen
    and kv-cache forms), merge the two with both merge functions."""
    flashserve.reshape_and_cache_flash(k_new, v_new, k_cache, v_cache, slot_mapping, "auto",
                                       scale, scale)
    out, lse = flashserve.flash_attn_varlen_func(q, k_cache, v_cache, 1, cu_q, max_seqlen_k,
                                                 seqused_k=seqused_k, block_table=block_table,
                                                 causal=True, return_softmax_lse=True)
    out2, lse2 = flashserve.flash_attn_with_kvcache(q[:, None], k_cache, v_cache,
                                                    cache_seqlens=seqused_k,
                                                    block_table=block_table, causal=True,
                                                    return_softmax_lse=True)
    merged = torch.empty_like(out)
    merged_lse = torch.empty_like(lse)
    flashserve.merge_attn_states(merged, out, lse, out2[:, 0], lse2[:, :, 0].T.contiguous(),
                                 output_lse=merged_lse)
    v2, s2 = flashserve.merge_state_v2(out, lse.T.contiguous(), out2[:, 0], lse2[:, :, 0])
    return out, lse, out2, lse2, merged, merged_lse, v2, s2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_decode_step(case: Case, device: str, mode: str) -> None:
    """torch.compile(fullgraph=True) of a decode step calling every drop-in equals eager, bit
    for bit, caches included (CPU: the aot_eager backend; CUDA: inductor, with CUDA graphs in
    reduce-overhead)."""
    if device == "cpu" and mode != "default":
        pytest.skip("reduce-overhead is CUDA graphs")
    batch, cap = 4, 100
    lens, slots, kv = decode_batch(case, device, batch, cap, dtype=torch.float16)
    q = case.randn(batch, 8, 128, dtype=torch.float16, device=device)
    k_new, v_new = (case.randn(batch, 2, 128, dtype=torch.float16, device=device) for _ in range(2))
    args = dict(q=q, k_new=k_new, v_new=v_new, slot_mapping=torch.tensor(slots, device=device),
                cu_q=cu_seqlens([1] * batch, device), scale=torch.tensor(1.0, device=device),
                seqused_k=torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=device),
                block_table=kv.block_table, max_seqlen_k=cap)
    case.desc = f"lens={lens} slots={slots} mode={mode}"
    caches = [(kv.k_cache.clone(), kv.v_cache.clone()) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True,
                             backend="aot_eager" if device == "cpu" else "inductor",
                             mode=None if device == "cpu" else mode)
    eager = decode_step(k_cache=caches[0][0], v_cache=caches[0][1], **args)
    for _ in range(2 if mode == "reduce-overhead" else 1):  # recorded, then replayed
        got = compiled(k_cache=caches[1][0], v_cache=caches[1][1], **args)
    names = ["varlen out", "varlen lse", "kvcache out", "kvcache lse", "merge_attn_states out",
             "merge_attn_states lse", "merge_state_v2 v", "merge_state_v2 s"]
    for name, a, b in zip(names, got, eager):
        check_bits(case, f"compiled {name}", a, b)
    check_bits(case, "compiled key_cache", caches[1][0], caches[0][0])
    check_bits(case, "compiled value_cache", caches[1][1], caches[0][1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("api", ["with_kvcache", "varlen"])
@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("metadata", [False, True], ids=["no_metadata", "scheduler_metadata"])
def test_graph_decode_replay(case: Case, device: str, api: str, num_splits: int,
                             metadata: bool) -> None:
    """A decode call captured once (CUDA graph; on the CPU the same static buffers re-run) and
    replayed over new lengths (padding rows of length 0), block tables, caches and q equals the
    reference each step, and eager bit for bit without splits."""
    block_size, heads, heads_kv, d, dtype = 16, 8, 2, 128, torch.bfloat16
    batch, cap = (8, 704) if device == "cuda" else (4, 96)  # cap: whole blocks
    max_blocks = -(-cap // block_size)
    num_blocks = batch * max_blocks + 8
    # K and V interleaved per block, HND, exposed as [num_blocks, block_size, H_kv, D] views.
    kv = torch.zeros(num_blocks, 2, heads_kv, block_size, d, dtype=dtype, device=device)
    k_cache, v_cache = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
    seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
    q = torch.zeros(batch, 1, heads, d, dtype=dtype, device=device)
    out = torch.zeros_like(q)
    kw = dict(causal=True, num_splits=num_splits)
    if metadata:
        kw["scheduler_metadata"] = flashserve.get_scheduler_metadata(
            batch, 1, cap, heads, heads_kv, d, seqlens, qkv_dtype=dtype, page_size=block_size,
            causal=True, num_splits=num_splits)
    cu_q = cu_seqlens([1] * batch, device)

    def call():
        if api == "with_kvcache":
            return flashserve.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                      block_table=block_table, out=out, **kw)
        return flashserve.flash_attn_varlen_func(q.view(batch, heads, d), k_cache, v_cache, 1,
                                                 cu_q, cap, seqused_k=seqlens,
                                                 block_table=block_table, out=out.view(batch, heads, d),
                                                 **kw)

    graph = capture(call, device)
    for step in range(4):
        live = batch if step % 2 == 0 else case.rng.randint(1, batch)
        lens = [n if b < live else 0 for b, n in enumerate(seq_lens(case, batch, cap))]
        case.desc = f"step {step}: lens={lens}"
        k_cache.copy_(torch.randn(k_cache.shape, generator=case.gen).to(dtype))
        v_cache.copy_(torch.randn(v_cache.shape, generator=case.gen).to(dtype))
        ids = torch.tensor(case.perm(num_blocks)[: batch * max_blocks], dtype=torch.int32)
        block_table.copy_(ids.view(batch, max_blocks))
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=case.gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        if device == "cuda":
            torch.cuda.synchronize()
        replayed = out.clone()
        keys = [gather_paged(k_cache, block_table[b], n) for b, n in enumerate(lens)]
        values = [gather_paged(v_cache, block_table[b], n) for b, n in enumerate(lens)]
        ref, _ = batched_ref(q, keys, values, scale=d ** -0.5, causal=True)
        check_out(case, "replayed out", replayed, ref, cap)
        if num_splits == 1:
            out.fill_(float("nan"))
            call()
            check_bits(case, "replayed vs eager", replayed, out)


@pytest.mark.parametrize("device", DEVICES)
def test_inference_mode_decode_step(case: Case, device: str) -> None:
    """The top-level drop-ins under torch.inference_mode (a decode step calling each, and
    get_scheduler_metadata whose result is copied into a slice of a persistent buffer and
    passed back) equal the same calls outside it, bit for bit, caches included."""
    batch, cap = 4, 100
    lens, slots, kv = decode_batch(case, device, batch, cap, dtype=torch.float16)
    q = case.randn(batch, 8, 128, dtype=torch.float16, device=device)
    k_new, v_new = (case.randn(batch, 2, 128, dtype=torch.float16, device=device) for _ in range(2))
    seqused = torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=device)
    args = dict(q=q, k_new=k_new, v_new=v_new, slot_mapping=torch.tensor(slots, device=device),
                cu_q=cu_seqlens([1] * batch, device), scale=torch.tensor(1.0, device=device),
                seqused_k=seqused, block_table=kv.block_table, max_seqlen_k=cap)
    case.desc = f"lens={lens} slots={slots}"
    caches = [(kv.k_cache.clone(), kv.v_cache.clone()) for _ in range(2)]
    eager = decode_step(k_cache=caches[0][0], v_cache=caches[0][1], **args)
    width = kv.block_table.shape[1] * kv.k_cache.shape[1]
    md_args = (batch, 1, width, 8, 2, 128, seqused)
    md_kw = dict(qkv_dtype=torch.float16, page_size=kv.k_cache.shape[1], causal=True)
    kw = dict(cache_seqlens=seqused, block_table=kv.block_table, causal=True)
    plain = flashserve.flash_attn_with_kvcache(q[:, None], caches[0][0], caches[0][1],
                                               scheduler_metadata=flashserve.get_scheduler_metadata(*md_args, **md_kw),
                                               **kw)
    with torch.inference_mode():
        got = decode_step(k_cache=caches[1][0], v_cache=caches[1][1], **args)
        md = flashserve.get_scheduler_metadata(*md_args, **md_kw)
        buffer = torch.zeros(256, dtype=torch.int32, device=device)
        buffer[:md.shape[0]] = md
        planned = flashserve.flash_attn_with_kvcache(q[:, None], caches[1][0], caches[1][1],
                                                     scheduler_metadata=buffer[:md.shape[0]], **kw)
    for i, (a, b) in enumerate(zip(got, eager)):
        check_bits(case, f"inference_mode result {i}", a, b)
    check_bits(case, "key_cache", caches[1][0], caches[0][0])
    check_bits(case, "with scheduler metadata", planned, plain)
