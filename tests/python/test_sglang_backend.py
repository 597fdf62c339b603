"""flashserve.sglang.FlashAttentionBackend, driven the way SGLang's model runner drives its
FlashAttention backend: a model runner, a req_to_token pool (token-granular page tables), a KV
pool (set_kv_buffer / get_kv_buffer, set_mla_kv_buffer / get_key_buffer), RadixAttention
layers and ForwardBatches (out_cache_loc, extend_prefix_lens, extend_seq_lens, seq_lens,
forward modes, spec_info with draft tokens, top-k and the tree's custom_mask) as duck-typed
stand-ins built as SGLang builds them. Outputs are compared with the fp64 reference of
torch_reference.py; the KV written by the forward is checked bit for bit; pool slots no
request owns hold NaN, so a read of one shows. The stand-ins, batch builders and references
are in sglang_world.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
flashserve = pytest.importorskip("flashserve")

from flashserve.sgl import merge_state_v2  # noqa: E402
from flashserve.sglang import (FlashAttentionMultiStepBackend, local_virtual_batches,  # noqa: E402
                               make_local_attention_virtual_batches)

from helpers_torch import DEVICES, Case, capture, check_bits, check_lse, check_out  # noqa: E402
from sglang_world import (BF16, CUDA, GRAPH_MODES, NS, UNPADDED, ForwardMode, GraphStep, World,  # noqa: E402
                          _graph_backend, check_verify_tree, check_written, draft_decode_batch, extend_batch,
                          graph_world, lens, mla_ref, new_kv, radix_layer, ref_rows, verify_tree_batch)
from torch_reference import attention_ref  # noqa: E402

@pytest.fixture
def case(request) -> Case:
    return Case(request)


# ----------------------------------------------------------------------------- extend / decode / mixed

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND],
                         ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_with_prefix(case: Case, device: str, mode: ForwardMode, page_size: int) -> None:
    """forward_extend: each request's new tokens (written at out_cache_loc) attend causally to
    its cached prefix and themselves; MIXED batches hold decode requests (one new token);
    no-prefix batches take SGLang's cu_seqlens_q = cu_seqlens_k path; sinks and logit_cap."""
    for i in range(3):
        world = World(case, device, page_size=page_size, heads_kv=2, d=64)
        batch = case.rng.randint(1, 4)
        no_prefix = mode == ForwardMode.EXTEND and i == 0
        prefix = [0] * batch if no_prefix else lens(case, batch, 0, 40)
        ext = lens(case, batch, 1, 12)
        if mode == ForwardMode.MIXED:
            ext = [1 if case.rng.random() < 0.5 else e for e in ext]
            prefix = [p + 1 if e == 1 else p for p, e in zip(prefix, ext)]
        fb = extend_batch(world, mode, prefix, ext)
        layer = radix_layer(8, 2, 64, logit_cap=case.rng.choice([0.0, 20.0]))
        sinks = (torch.randn(8, generator=case.gen) * 2).to(device) if case.rng.random() < 0.4 else None
        case.desc = (f"case {i}: prefix={prefix} ext={ext} page={page_size} cap={layer.logit_cap} "
                     f"sinks={sinks is not None}")
        backend = world.backend()
        backend.init_forward_metadata(fb)
        total = sum(ext)
        q = case.randn(total, 8 * 64, dtype=BF16, device=device)
        k, v = new_kv(world, total, layer)
        out = backend.forward_extend(q, k, v, layer, fb, sinks=sinks)
        assert out.shape == (total, 8 * 64)
        check_written(case, world, fb.out_cache_loc, k, v)
        row = 0
        for b, r in enumerate(fb.req_pool_indices.tolist()):
            slots = world.slots(r, 0, prefix[b] + ext[b])
            ref = ref_rows(q[row:row + ext[b]].view(-1, 8, 64), world.k_rows(slots), world.v_rows(slots), layer,
                           causal=True, sink=sinks)
            check_out(case, f"request {b}", out[row:row + ext[b]].view(-1, 8, 64), ref)
            row += ext[b]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("swa", [False, True])
def test_decode(case: Case, device: str, page_size: int, swa: bool) -> None:
    """forward_decode: one new token per request written at out_cache_loc, attending to its
    whole sequence (sliding-window layers: the last sliding_window_size + 1 tokens)."""
    for i in range(3):
        window = case.rng.randint(0, 12) if swa else -1
        world = World(case, device, page_size=page_size, heads_kv=2, d=128, swa=window if swa else None)
        batch = case.rng.randint(1, 5)
        seq = lens(case, batch, 1, 60)
        reqs = [world.new_request(n, n - 1) for n in seq]
        loc = torch.stack([world.slots(r, n - 1, n)[0] for r, n in zip(reqs, seq)])
        fb = world.batch(ForwardMode.DECODE, reqs, seq, out_cache_loc=loc)
        layer = radix_layer(4, 2, 128, window=window)
        case.desc = f"case {i}: seq={seq} page={page_size} window={window}"
        backend = world.backend()
        backend.init_forward_metadata(fb)
        q = case.randn(batch, 4 * 128, dtype=BF16, device=device)
        k, v = new_kv(world, batch, layer)
        out = backend.forward(q, k, v, layer, fb)  # AttentionBackend.forward dispatches DECODE
        check_written(case, world, loc, k, v)
        for b, (r, n) in enumerate(zip(reqs, seq)):
            slots = world.slots(r, 0, n)
            ref = ref_rows(q[b].view(1, 4, 128), world.k_rows(slots), world.v_rows(slots), layer, causal=True,
                           window=(window, 0))
            check_out(case, f"request {b}", out[b].view(1, 4, 128), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=lambda m: m.name)
def test_fp8_kv_cache(case: Case, device: str, mode: ForwardMode) -> None:
    """kv_cache_dtype fp8_e4m3: the pool stores k / k_scale in fp8; SGLang casts q to the cache
    dtype and passes k_scale / v_scale expanded to [bs, H_kv] as descales; out is bf16."""
    fp8 = torch.float8_e4m3fn
    for i in range(2):
        world = World(case, device, page_size=case.rng.choice([1, 16]), dtype=fp8)
        world.runner.server_args.kv_cache_dtype = "fp8_e4m3"
        batch = case.rng.randint(1, 3)
        prefix = lens(case, batch, 0, 40)
        ext = [1] * batch if mode == ForwardMode.DECODE else lens(case, batch, 1, 8)
        fb = extend_batch(world, mode, prefix, ext)
        layer = radix_layer(4, 2, 64)
        layer.k_scale = torch.tensor(case.rng.uniform(0.5, 2.0), dtype=torch.float32, device=device)
        layer.v_scale = torch.tensor(case.rng.uniform(0.5, 2.0), dtype=torch.float32, device=device)
        case.desc = f"case {i}: prefix={prefix} ext={ext} page={world.page_size} scales={layer.k_scale.item():.3f}," \
                    f"{layer.v_scale.item():.3f}"
        backend = world.backend()
        backend.init_forward_metadata(fb)
        total = sum(ext)
        q = case.randn(total, 4 * 64, dtype=BF16, device=device)
        k = case.randn(total, 2, 64, dtype=BF16, device=device)
        v = case.randn(total, 2, 64, dtype=BF16, device=device)
        out = case.call(backend.forward, q, k, v, layer, fb)
        if out is None:  # fp8 q/cache not implemented on this device
            continue
        assert out.dtype == BF16
        row = 0
        for b, r in enumerate(fb.req_pool_indices.tolist()):
            slots = world.slots(r, 0, prefix[b] + ext[b])
            rows = slice(row, row + ext[b])
            qb = q[rows].view(-1, 4, 64).to(fp8).float()
            ref = ref_rows(qb, world.k_rows(slots) * layer.k_scale.item(), world.v_rows(slots) * layer.v_scale.item(),
                           layer, causal=True)
            check_out(case, f"request {b}", out[rows].view(-1, 4, 64), ref)
            row += ext[b]
    case.done()


# ----------------------------------------------------------------------------- speculative decoding


@pytest.mark.parametrize("device", DEVICES)
def test_target_verify_topk1(case: Case, device: str) -> None:
    """TARGET_VERIFY, top-k 1: the draft chain's tokens (after each request's prefix in
    req_to_token) attend causally to prefix + chain."""
    n_draft = 4
    for i in range(3):
        page_size = case.rng.choice([1, 4])
        world = World(case, device, page_size=page_size, topk=1, n_draft=n_draft)
        batch = case.rng.randint(1, 4)
        prefix = lens(case, batch, 1, 50)
        reqs = [world.new_request(p + n_draft, p) for p in prefix]
        loc = torch.cat([world.slots(r, p, p + n_draft) for r, p in zip(reqs, prefix)])
        fb = world.batch(ForwardMode.TARGET_VERIFY, reqs, prefix, out_cache_loc=loc,
                         spec_info=NS(draft_token_num=n_draft, topk=1, custom_mask=None))
        layer = radix_layer(4, 2, 64)
        case.desc = f"case {i}: prefix={prefix} page={page_size}"
        backend = world.backend()
        backend.init_forward_metadata(fb)
        q = case.randn(batch * n_draft, 4 * 64, dtype=BF16, device=device)
        k, v = new_kv(world, batch * n_draft, layer)
        out = backend.forward_extend(q, k, v, layer, fb)
        check_written(case, world, loc, k, v)
        for b, (r, p) in enumerate(zip(reqs, prefix)):
            slots = world.slots(r, 0, p + n_draft)
            rows = slice(b * n_draft, (b + 1) * n_draft)
            ref = ref_rows(q[rows].view(-1, 4, 64), world.k_rows(slots), world.v_rows(slots), layer, causal=True)
            check_out(case, f"request {b}", out[rows].view(-1, 4, 64), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("swa", [False, True])
def test_target_verify_tree(case: Case, device: str, swa: bool) -> None:
    """TARGET_VERIFY, top-k > 1: each draft token sees its prefix and the draft tokens the
    tree's custom_mask shows. Full-attention layers: prefix pass (causal=False) + expand pass
    merged with merge_state_v2; sliding-window layers (model with SWA): one concatenated page
    table per draft token, causal with the window counted along its own path."""
    n_draft = 5
    for i in range(3):
        window = case.rng.randint(1, 10) if swa else -1
        world = World(case, device, topk=2, n_draft=n_draft, swa=window if swa else None)
        fb, reqs, prefix, trees = verify_tree_batch(case, world, n_draft, case.rng.randint(1, 3))
        layer = radix_layer(4, 2, 64, window=window)
        case.desc = f"case {i}: prefix={prefix} window={window} trees={trees}"
        backend = world.backend()
        backend.init_forward_metadata(fb)
        assert backend.forward_metadata_spec_decode_expand is not None
        assert (backend.forward_metadata.swa_spec_metadata is not None) == swa
        q = case.randn(len(reqs) * n_draft, 4 * 64, dtype=BF16, device=device)
        k, v = new_kv(world, len(reqs) * n_draft, layer)
        out = backend.forward_extend(q, k, v, layer, fb)
        check_written(case, world, fb.out_cache_loc, k, v)
        check_verify_tree(case, world, out, q, layer, reqs, prefix, trees, n_draft)
        if swa:  # a full-attention layer of the same SWA model takes the merged path
            full = radix_layer(4, 2, 64)
            out_full = backend.forward_extend(q, None, None, full, fb)
            check_verify_tree(case, world, out_full, q, full, reqs, prefix, trees, n_draft)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("sinks", [False, True])
def test_draft_decode_topk(case: Case, device: str, topk: int, sinks: bool) -> None:
    """Draft decode, top-k > 1: each branch's query attends to the shared prefix through the
    page table and to its own draft tokens (steps 0..step) through the expand table, two passes
    merged by LSE (FlashAttentionMultiStepBackend's per-step backends); a sink logit counts
    once in the merged softmax."""
    steps = 3
    for i in range(2):
        world = World(case, device, topk=topk, n_draft=steps * topk)
        step = case.rng.randint(0, steps - 1)
        fb, reqs, prefix, loc = draft_decode_batch(case, world, topk, steps, step, case.rng.randint(1, 3))
        multi = FlashAttentionMultiStepBackend(world.runner, topk, steps)
        backend = multi.attn_backends[step]
        backend.init_forward_metadata(fb)  # full out_cache_loc, as the draft worker passes it
        fb.out_cache_loc = loc[:, :, step].reshape(-1)  # this step's tokens, as set before the forward
        layer = radix_layer(4, 2, 64)
        case.desc = f"case {i}: prefix={prefix} step={step}/{steps} topk={topk}"
        n = len(reqs) * topk
        q = case.randn(n, 4 * 64, dtype=BF16, device=device)
        k, v = new_kv(world, n, layer)
        sink = (torch.randn(4, generator=case.gen) * 2 + 2).to(device) if sinks else None
        out = backend.forward_decode(q, k, v, layer, fb, sinks=sink)
        check_written(case, world, fb.out_cache_loc, k, v)
        for b, (r, p) in enumerate(zip(reqs, prefix)):
            for j in range(topk):
                slots = torch.cat([world.slots(r, 0, p), loc[b, j, :step + 1]])
                t = b * topk + j
                ref = ref_rows(q[t].view(1, 4, 64), world.k_rows(slots), world.v_rows(slots), layer, sink=sink)
                check_out(case, f"request {b} branch {j}", out[t].view(1, 4, 64), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_multistep_draft_graph_metadata(case: Case, device: str) -> None:
    """FlashAttentionMultiStepBackend under CUDA graphs: one capture and one replay for all
    draft steps (forward batch API), then the steps run in order, each writing its token and
    attending to the prefix and its branch's tokens so far."""
    topk, steps, bs = 2, 3, 2
    world = World(case, device, topk=topk, n_draft=steps * topk, max_reqs=16)
    multi = FlashAttentionMultiStepBackend(world.runner, topk, steps)
    multi.init_cuda_graph_state(4, 4 * topk)
    dummy, *_ = draft_decode_batch(case, world, topk, steps, 0, bs)
    multi.init_forward_metadata_capture_cuda_graph(dummy)
    fb, reqs, prefix, loc = draft_decode_batch(case, world, topk, steps, 0, bs)
    multi.init_forward_metadata_replay_cuda_graph(fb, bs)
    layer = radix_layer(4, 2, 64)
    case.desc = f"prefix={prefix}"
    for step in range(steps - 1):
        q = case.randn(bs * topk, 4 * 64, dtype=BF16, device=device)
        k, v = new_kv(world, bs * topk, layer)
        fb.out_cache_loc = loc[:, :, step].reshape(-1)
        out = multi.attn_backends[step].forward_decode(q, k, v, layer, fb)
        for b, (r, p) in enumerate(zip(reqs, prefix)):
            for j in range(topk):
                slots = torch.cat([world.slots(r, 0, p), loc[b, j, :step + 1]])
                t = b * topk + j
                ref = ref_rows(q[t].view(1, 4, 64), world.k_rows(slots), world.v_rows(slots), layer)
                check_out(case, f"step {step} request {b} branch {j}", out[t].view(1, 4, 64), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_draft_decode_topk1(case: Case, device: str) -> None:
    """Draft decode, top-k 1: step s's token sits at req_to_token[prefix + s]; the query sees
    prefix + steps 0..s through the page table."""
    steps = 3
    for i in range(2):
        world = World(case, device, page_size=case.rng.choice([1, 4]), topk=1, n_draft=steps + 1)
        step = case.rng.randint(0, steps - 1)
        prefix = lens(case, case.rng.randint(1, 3), 1, 40)
        reqs = [world.new_request(p + steps, p + step) for p in prefix]
        loc = torch.stack([world.slots(r, p + step, p + step + 1)[0] for r, p in zip(reqs, prefix)])
        fb = world.batch(ForwardMode.DECODE, reqs, prefix, out_cache_loc=loc, spec_info=NS(topk=1))
        backend = world.backend(speculative_step_id=step, topk=1, speculative_num_steps=steps)
        backend.init_forward_metadata(fb)
        layer = radix_layer(4, 2, 64)
        case.desc = f"case {i}: prefix={prefix} step={step} page={world.page_size}"
        q = case.randn(len(reqs), 4 * 64, dtype=BF16, device=device)
        k, v = new_kv(world, len(reqs), layer)
        out = backend.forward_decode(q, k, v, layer, fb)
        for b, (r, p) in enumerate(zip(reqs, prefix)):
            slots = world.slots(r, 0, p + step + 1)
            ref = ref_rows(q[b].view(1, 4, 64), world.k_rows(slots), world.v_rows(slots), layer)
            check_out(case, f"request {b}", out[b].view(1, 4, 64), ref)


# ----------------------------------------------------------------------------- chunked local attention

def test_local_attention_virtual_batches_example() -> None:
    """SGLang's comment example (SPEC.md §6)."""
    import numpy as np
    table = torch.arange(30, dtype=torch.int32).view(3, 10)
    q_local, cu_q, k_local, table_local = make_local_attention_virtual_batches(
        4, np.array([0, 4, 14, 19]), np.array([6, 17, 9]), table, 2)
    assert q_local.tolist() == [2, 2, 1, 4, 4, 1, 4, 1]
    assert cu_q.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19]
    assert k_local.tolist() == [4, 2, 4, 4, 4, 1, 4, 1]
    assert table_local.tolist() == [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]


def test_local_virtual_batches_cpp_planner_matches_sglang(case: Case) -> None:
    """The C++ planner's virtual batches (local_virtual_batches) equal SGLang's numpy
    make_local_attention_virtual_batches whenever the longest sequence reaches the chunk."""
    import numpy as np
    for i in range(20):
        page = case.rng.choice([1, 2, 4])
        chunk = page * case.rng.randint(1, 6)
        batch = case.rng.randint(1, 5)
        k_lens = lens(case, batch, 1, 40)
        k_lens[0] = max(k_lens[0], chunk)
        q_lens = [case.rng.randint(1, n) for n in k_lens]
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        seq = np.array(k_lens, dtype=np.int32)
        table = torch.randint(0, 1000, (batch, -(-max(k_lens) // page) + 2), generator=case.gen, dtype=torch.int32)
        case.desc = f"case {i}: chunk={chunk} page={page} q={q_lens} k={k_lens}"
        ours = local_virtual_batches(chunk, qsl, seq, table, page)
        ref = make_local_attention_virtual_batches(chunk, qsl, seq, table, page)
        for name, a, b in zip(("seqlens_q", "cu_seqlens_q", "seqlens_k"), ours[:3], ref[:3]):
            assert a.tolist() == b.tolist(), f"{name}: {a.tolist()} != {b.tolist()} ({case.where()})"
        # block table entries past each virtual request's keys are never read
        for v, n in enumerate(ref[2].tolist()):
            pages = -(-n // page)
            assert ours[3][v, :pages].tolist() == ref[3][v, :pages].tolist(), case.where()
    with pytest.raises(ValueError, match="attention_chunk_size"):
        local_virtual_batches(6, np.array([0, 1], dtype=np.int32), np.array([8], dtype=np.int32),
                              torch.zeros(1, 4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="seq_lens"):
        local_virtual_batches(4, np.array([0, 5], dtype=np.int32), np.array([3], dtype=np.int32),
                              torch.zeros(1, 4, dtype=torch.int32), 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
def test_chunked_local_attention(case: Case, device: str, mode: ForwardMode) -> None:
    """attention_chunk_size (Llama 4's iRoPE layers, use_irope): queries see only keys of their
    own chunk, through virtual batches; layers without use_irope see everything."""
    chunk = 8
    for i in range(3):
        page_size = case.rng.choice([1, 4])
        world = World(case, device, page_size=page_size, chunk=chunk)
        batch = case.rng.randint(1, 4)
        if mode == ForwardMode.EXTEND:
            prefix, ext = lens(case, batch, 0, 30), lens(case, batch, 1, 20)
        else:
            prefix, ext = lens(case, batch, 0, 40), [1] * batch
        prefix[0] = max(prefix[0], chunk)  # max_seq_len >= chunk: SGLang shrinks the chunk otherwise
        fb = extend_batch(world, mode, prefix, ext)
        case.desc = f"case {i}: prefix={prefix} ext={ext} page={page_size}"
        backend = world.backend()
        backend.init_forward_metadata(fb)
        assert backend.forward_metadata.local_attn_metadata is not None
        total = sum(ext)
        q = case.randn(total, 4 * 64, dtype=BF16, device=device)
        for irope in (True, False):
            layer = radix_layer(4, 2, 64, irope=irope)
            k, v = new_kv(world, total, layer)
            out = backend.forward(q, k, v, layer, fb)
            row = 0
            for b, r in enumerate(fb.req_pool_indices.tolist()):
                slots = world.slots(r, 0, prefix[b] + ext[b])
                ref = ref_rows(q[row:row + ext[b]].view(-1, 4, 64), world.k_rows(slots), world.v_rows(slots), layer,
                               causal=True, chunk=chunk if irope else 0)
                check_out(case, f"request {b} irope={irope}", out[row:row + ext[b]].view(-1, 4, 64), ref)
                row += ext[b]


# ----------------------------------------------------------------------------- MLA


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=lambda m: m.name)
@pytest.mark.parametrize("split_q", [True, False])
def test_mla_absorbed(case: Case, device: str, mode: ForwardMode, split_q: bool) -> None:
    """MLA in the absorbed form over a latent cache [tokens, 1, 512 + 64]: q_rope against the
    rope part, qv = q_nope against c_kv (q given whole [T, H * 576] or as q + q_rope);
    set_mla_kv_buffer writes (c_kv, k_rope)."""
    rank, rope, heads = 512, 64, 4
    for i in range(2):
        world = World(case, device, page_size=case.rng.choice([1, 8]), mla=True, d=rank + rope)
        batch = case.rng.randint(1, 3)
        prefix = lens(case, batch, 0, 30)
        ext = [1] * batch if mode == ForwardMode.DECODE else lens(case, batch, 1, 8)
        fb = extend_batch(world, mode, prefix, ext)
        layer = radix_layer(heads, 1, rank + rope, rank, scaling=192 ** -0.5)
        case.desc = f"case {i}: prefix={prefix} ext={ext} page={world.page_size}"
        backend = world.backend()
        backend.init_forward_metadata(fb)
        total = sum(ext)
        q_nope = case.randn(total, heads, rank, dtype=BF16, device=device, scale=0.2)
        q_rope = case.randn(total, heads, rope, dtype=BF16, device=device)
        c_kv = case.randn(total, 1, rank, dtype=BF16, device=device, scale=0.5)
        k_rope = case.randn(total, 1, rope, dtype=BF16, device=device)
        fwd = backend.forward_decode if mode == ForwardMode.DECODE else backend.forward_extend
        if split_q:
            out = fwd(q_nope.reshape(total, -1), c_kv, c_kv, layer, fb, q_rope=q_rope.reshape(total, -1),
                      k_rope=k_rope)
        else:
            q = torch.cat([q_nope, q_rope], dim=-1).reshape(total, -1)
            out = fwd(q, c_kv, c_kv, layer, fb, k_rope=k_rope)
        assert out.shape == (total, heads * rank)
        buf = world.kv_pool.kv_buffer[0]
        check_bits(case, "latent written", buf[fb.out_cache_loc], torch.cat([c_kv, k_rope], dim=-1))
        row = 0
        for b, r in enumerate(fb.req_pool_indices.tolist()):
            latent = buf[world.slots(r, 0, prefix[b] + ext[b])].float()
            rows = slice(row, row + ext[b])
            ref = mla_ref(q_nope[rows], q_rope[rows], latent, layer)
            check_out(case, f"request {b}", out[rows].view(-1, heads, rank), ref, 512)
            row += ext[b]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["draft_decode", "verify_tree"])
def test_mla_topk(case: Case, device: str, kind: str) -> None:
    """Absorbed MLA under speculative top-k > 1: draft decode (prefix + each branch's own
    tokens) and target verify over a draft tree, both as two qv passes merged by LSE."""
    rank, rope, heads, topk, steps, n_draft = 512, 64, 4, 2, 3, 4
    world = World(case, device, mla=True, d=rank + rope, topk=topk, n_draft=n_draft)
    layer = radix_layer(heads, 1, rank + rope, rank, scaling=192 ** -0.5)
    batch = case.rng.randint(1, 2)
    if kind == "draft_decode":
        step = case.rng.randint(0, steps - 1)
        fb, reqs, prefix, loc = draft_decode_batch(case, world, topk, steps, step, batch)
        backend = world.backend(speculative_step_id=step, topk=topk, speculative_num_steps=steps)
        backend.init_forward_metadata(fb)
        fb.out_cache_loc = loc[:, :, step].reshape(-1)
        seen = [torch.cat([world.slots(r, 0, p), loc[b, j, :step + 1]])
                for b, (r, p) in enumerate(zip(reqs, prefix)) for j in range(topk)]
    else:
        fb, reqs, prefix, trees = verify_tree_batch(case, world, n_draft, batch)
        backend = world.backend()
        backend.init_forward_metadata(fb)
        seen = [torch.cat([world.slots(r, 0, p), world.slots(r, p, p + n_draft)[[j for j in range(n_draft)
                                                                                 if trees[b][i][j]]]])
                for b, (r, p) in enumerate(zip(reqs, prefix)) for i in range(n_draft)]
    case.desc = f"{kind}: prefix={prefix}"
    n = len(seen)
    q_nope = case.randn(n, heads, rank, dtype=BF16, device=device, scale=0.2)
    q_rope = case.randn(n, heads, rope, dtype=BF16, device=device)
    c_kv = case.randn(n, 1, rank, dtype=BF16, device=device, scale=0.5)
    k_rope = case.randn(n, 1, rope, dtype=BF16, device=device)
    fwd = backend.forward_decode if kind == "draft_decode" else backend.forward_extend
    out = fwd(q_nope.reshape(n, -1), c_kv, c_kv, layer, fb, q_rope=q_rope.reshape(n, -1), k_rope=k_rope)
    buf = world.kv_pool.kv_buffer[0]
    for t, slots in enumerate(seen):
        ref = mla_ref(q_nope[t:t + 1], q_rope[t:t + 1], buf[slots].float(), layer)
        check_out(case, f"row {t}", out[t].view(1, heads, rank), ref, 512)


@pytest.mark.parametrize("device", DEVICES)
def test_mla_mha_prefill_chunked_prefix(case: Case, device: str) -> None:
    """MLA models' MHA prefill, D 192 / Dv 128: the new tokens against themselves
    (attn_attend_prefix_cache False, causal) and against a chunk of the decompressed prefix
    (True, non-causal), each with its LSE [tokens, H]; merged by merge_state_v2 (as
    DeepSeek-V2's model does) it equals causal attention over prefix + new tokens."""
    heads, d, dv = 4, 192, 128
    world = World(case, device, mla=True, d=576)
    batch = case.rng.randint(1, 3)
    prefix, ext = lens(case, batch, 1, 30), lens(case, batch, 1, 10)
    fb = extend_batch(world, ForwardMode.EXTEND, prefix, ext)
    backend = world.backend()
    backend.init_forward_metadata(fb)
    layer = radix_layer(heads, heads, d, dv, scaling=d ** -0.5)
    case.desc = f"prefix={prefix} ext={ext}"
    total = sum(ext)
    q = case.randn(total, heads * d, dtype=BF16, device=device)
    k = case.randn(total, heads, d, dtype=BF16, device=device)
    v = case.randn(total, heads, dv, dtype=BF16, device=device)
    pk = case.randn(sum(prefix), heads, d, dtype=BF16, device=device)
    pv = case.randn(sum(prefix), heads, dv, dtype=BF16, device=device)
    fb.mha_return_lse = True
    fb.attn_attend_prefix_cache = False
    o_new, lse_new = backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    cu = [0]
    for p in prefix:
        cu.append(cu[-1] + p)
    fb.attn_attend_prefix_cache = True
    fb.prefix_chunk_idx = 0
    fb.prefix_chunk_cu_seq_lens = torch.tensor([cu], dtype=torch.int32, device=device)
    fb.prefix_chunk_max_seq_lens = [max(prefix)]
    o_pre, lse_pre = backend.forward_extend(q, pk, pv, layer, fb, save_kv_cache=False)
    assert lse_new.shape == (total, heads) and lse_pre.shape == (total, heads)
    merged, lse = merge_state_v2(o_new, lse_new, o_pre, lse_pre)
    row = 0
    for b in range(batch):
        rows = slice(row, row + ext[b])
        keys = torch.cat([pk[cu[b]:cu[b + 1]], k[rows]]).float()
        vals = torch.cat([pv[cu[b]:cu[b + 1]], v[rows]]).float()
        ref_o, ref_lse = attention_ref(q[rows].view(-1, heads, d), keys, vals, scale=layer.scaling, causal=True)
        check_out(case, f"request {b} merged", merged[rows], ref_o)
        check_lse(case, f"request {b} lse", lse[rows], ref_lse.T)
        row += ext[b]


# ----------------------------------------------------------------------------- encoder / cross attention

@pytest.mark.parametrize("device", DEVICES)
def test_cross_attention(case: Case, device: str) -> None:
    """Encoder-decoder (mllama-like): req_to_token holds each request's encoder tokens, then
    its decoder tokens. Cross-attention layers write the encoder K/V at encoder_out_cache_loc
    during the prefill and attend non-causally to it (prefill and decode); self-attention
    layers attend causally to the decoder tokens only."""
    world = World(case, device, encdec=True)
    batch = case.rng.randint(1, 3)
    enc = lens(case, batch, 1, 20)
    prefix, ext = [0] * batch, lens(case, batch, 1, 8)
    reqs = [world.new_request(e + n + 1, 0) for e, n in zip(enc, ext)]
    loc = torch.cat([world.slots(r, e, e + n) for r, e, n in zip(reqs, enc, ext)])
    enc_loc = torch.cat([world.slots(r, 0, e) for r, e in zip(reqs, enc)])
    fb = world.batch(ForwardMode.EXTEND, reqs, ext, out_cache_loc=loc, encoder_out_cache_loc=enc_loc,
                     encoder_lens=torch.tensor(enc, dtype=torch.int32, device=device),
                     extend_prefix_lens=torch.zeros(batch, dtype=torch.int32, device=device),
                     extend_prefix_lens_cpu=prefix,
                     extend_seq_lens=torch.tensor(ext, dtype=torch.int32, device=device), extend_seq_lens_cpu=ext)
    case.desc = f"enc={enc} ext={ext}"
    backend = world.backend()
    backend.init_forward_metadata(fb)
    self_layer, cross_layer = radix_layer(4, 2, 64), radix_layer(4, 2, 64, cross=True)
    total = sum(ext)
    q = case.randn(total, 4 * 64, dtype=BF16, device=device)
    ke, ve = new_kv(world, sum(enc), cross_layer)
    out_cross = backend.forward_extend(q, ke, ve, cross_layer, fb)
    check_written(case, world, enc_loc, ke, ve)
    k, v = new_kv(world, total, self_layer)
    out_self = backend.forward_extend(q, k, v, self_layer, fb)
    check_written(case, world, loc, k, v)
    row = 0
    for b, (r, e, n) in enumerate(zip(reqs, enc, ext)):
        rows = slice(row, row + n)
        es, ds = world.slots(r, 0, e), world.slots(r, e, e + n)
        ref_c = ref_rows(q[rows].view(-1, 4, 64), world.k_rows(es), world.v_rows(es), cross_layer)
        ref_s = ref_rows(q[rows].view(-1, 4, 64), world.k_rows(ds), world.v_rows(ds), self_layer, causal=True)
        check_out(case, f"request {b} cross", out_cross[rows].view(-1, 4, 64), ref_c)
        check_out(case, f"request {b} self", out_self[rows].view(-1, 4, 64), ref_s)
        row += n
    # one decode step: cross attention reads the cached encoder K/V (k=None), self attention appends
    seq = [n + 1 for n in ext]
    dloc = torch.stack([world.slots(r, e + n, e + n + 1)[0] for r, e, n in zip(reqs, enc, ext)])
    fd = world.batch(ForwardMode.DECODE, reqs, seq, out_cache_loc=dloc, encoder_out_cache_loc=None,
                     encoder_lens=torch.tensor(enc, dtype=torch.int32, device=device))
    backend.init_forward_metadata(fd)
    qd = case.randn(batch, 4 * 64, dtype=BF16, device=device)
    out_c = backend.forward_decode(qd, None, None, cross_layer, fd)
    kd, vd = new_kv(world, batch, self_layer)
    out_s = backend.forward_decode(qd, kd, vd, self_layer, fd)
    for b, (r, e, n) in enumerate(zip(reqs, enc, seq)):
        es, ds = world.slots(r, 0, e), world.slots(r, e, e + n)
        check_out(case, f"decode {b} cross", out_c[b].view(1, 4, 64),
                  ref_rows(qd[b].view(1, 4, 64), world.k_rows(es), world.v_rows(es), cross_layer))
        check_out(case, f"decode {b} self", out_s[b].view(1, 4, 64),
                  ref_rows(qd[b].view(1, 4, 64), world.k_rows(ds), world.v_rows(ds), self_layer, causal=True))


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", GRAPH_MODES)
def test_cuda_graph_metadata_replay(case: Case, device: str, kind: str) -> None:
    """init_cuda_graph_state, capture metadata at fixed batch sizes, then replays: each replay
    updates the captured metadata tensors in place (same storage) and the forward that reads
    them gives the reference result (run eagerly here; on CUDA also as a graph below)."""
    steps, max_bs = 3, 4
    world, layer = graph_world(case, device, kind, steps)
    step = case.rng.randint(0, steps - 1)
    backend = _graph_backend(world, kind, steps, step)
    backend.init_cuda_graph_state(max_bs, max_bs * 8)
    captured = {}
    for bs in (1, 2, max_bs):
        dummy = GraphStep(case, world, kind, bs, layer, steps, step)
        backend.init_forward_metadata_capture_cuda_graph(bs, dummy.graph_rows, dummy.fb.req_pool_indices,
                                                         dummy.fb.seq_lens, dummy.encoder_lens, dummy.mode,
                                                         dummy.spec)
        md = backend.forward_metadata
        captured[bs] = (md, [t.data_ptr() for t in (md.cache_seqlens_int32, md.cu_seqlens_q, md.page_table)])
    for i in range(4):
        bs = case.rng.choice([1, 2, max_bs])
        real = bs if i % 2 == 0 or kind in UNPADDED else case.rng.randint(1, bs)  # odd replays pad the batch
        step_in = GraphStep(case, world, kind, real, layer, steps, step)
        case.desc = f"replay {i}: kind={kind} bs={bs} real={real} seq={step_in.seq} step={step}"
        step_in.replay(backend, max_bs, bs)
        md, ptrs = captured[bs]
        assert backend.forward_metadata is md
        assert [t.data_ptr() for t in (md.cache_seqlens_int32, md.cu_seqlens_q, md.page_table)] == ptrs
        if kind in UNPADDED:  # eager: the rows of the batch (the CPU checks cu_seqlens_q[-1] == rows)
            q, k, v, fb = step_in.q, step_in.k, step_in.v, step_in.fb
        else:
            q, k, v, _, fb = step_in.padded(bs)
        fwd = backend.forward_decode if step_in.mode == ForwardMode.DECODE else backend.forward_extend
        out = fwd(q, k, v, layer, fb)
        if step_in.k is not None:
            check_written(case, world, step_in.loc, step_in.k, step_in.v)
        step_in.check(case, world, out[:step_in.q.shape[0]], layer, f"replay {i}")


@pytest.mark.skipif(not CUDA, reason="CUDA graph capture needs CUDA")
@pytest.mark.parametrize("kind", GRAPH_MODES)
def test_cuda_graph_capture_replay(case: Case, kind: str) -> None:
    """A torch.cuda.CUDAGraph captures the layer forward (KV write + attention + merge) for a
    fixed batch size; replays after init_forward_metadata_replay_cuda_graph, with new inputs
    copied into the static q/k/v/out_cache_loc, give the reference result."""
    device, steps, bs = "cuda", 3, 2
    world, layer = graph_world(case, device, kind, steps)
    step = case.rng.randint(0, steps - 1)
    backend = _graph_backend(world, kind, steps, step)
    backend.init_cuda_graph_state(bs, bs * 8)
    first = GraphStep(case, world, kind, bs, layer, steps, step)
    backend.init_forward_metadata_capture_cuda_graph(bs, first.graph_rows, first.fb.req_pool_indices,
                                                     first.fb.seq_lens, first.encoder_lens, first.mode, first.spec)
    first.replay(backend, bs)  # valid metadata for the warm-up and capture runs
    q0, k0, v0, loc0, _ = first.padded(bs)  # draft extend: bs * tokens per request rows
    static = NS(q=q0.clone(), k=None if k0 is None else k0.clone(), v=None if v0 is None else v0.clone(),
                loc=loc0.clone())
    fb = world.batch(first.mode, first.reqs, first.seq, out_cache_loc=static.loc, spec_info=first.spec)

    def run():
        if first.mode == ForwardMode.DECODE:
            return backend.forward_decode(static.q, static.k, static.v, layer, fb)
        return backend.forward_extend(static.q, static.k, static.v, layer, fb)

    captured = {}
    graph = capture(lambda: captured.update(out=run()), warmup=1)
    static_out = captured["out"]
    for i in range(4):
        real = bs if i % 2 == 0 or kind in UNPADDED else 1  # odd replays pad the batch
        step_in = GraphStep(case, world, kind, real, layer, steps, step)
        case.desc = f"replay {i}: kind={kind} real={real} seq={step_in.seq} step={step}"
        step_in.replay(backend, bs, bs)
        q, k, v, loc, _ = step_in.padded(bs)
        static.q.copy_(q)
        static.loc.copy_(loc)
        if k is not None:
            static.k.copy_(k)
            static.v.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        if k is not None:
            check_written(case, world, step_in.loc, step_in.k, step_in.v)
        step_in.check(case, world, static_out[:step_in.q.shape[0]], layer, f"graph replay {i}")


# ----------------------------------------------------------------------------- errors

def test_errors(case: Case) -> None:
    """Clear errors naming the argument; NotImplementedError naming unsupported features."""
    world = World(case, "cpu")
    layer = radix_layer(4, 2, 64)
    fb = extend_batch(world, ForwardMode.EXTEND, [3], [2])
    backend = world.backend()
    q = torch.zeros(2, 4 * 64, dtype=BF16)
    k, v = new_kv(world, 2, layer)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward_extend(q, k, v, layer, fb)
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="^q: "):
        backend.forward_extend(torch.zeros(2, 4 * 64 + 1, dtype=BF16), k, v, layer, fb)
    with pytest.raises(ValueError, match="^v: "):
        backend.forward_extend(q, k, None, layer, fb)
    fb.forward_mode = ForwardMode.SPLIT_PREFILL
    with pytest.raises(NotImplementedError, match="SPLIT_PREFILL"):
        backend.init_forward_metadata(fb)
    fb.forward_mode = "extend"
    with pytest.raises(ValueError, match="forward_mode"):
        backend.init_forward_metadata(fb)
    with pytest.raises(NotImplementedError, match="top-k > 1"):
        World(case, "cpu", page_size=4, topk=2, n_draft=4).backend()
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_replay_cuda_graph(1, fb.req_pool_indices, fb.seq_lens, 5, None,
                                                        ForwardMode.DECODE, None, fb.seq_lens_cpu)
    backend.init_cuda_graph_state(4, 32)
    with pytest.raises(ValueError, match="^bs: "):
        backend.init_forward_metadata_replay_cuda_graph(1, fb.req_pool_indices, fb.seq_lens, 5, None,
                                                        ForwardMode.DECODE, None, fb.seq_lens_cpu)
    with pytest.raises(NotImplementedError, match="EXTEND"):
        backend.init_forward_metadata_capture_cuda_graph(1, 1, fb.req_pool_indices, fb.seq_lens, None,
                                                         ForwardMode.EXTEND, None)
    fb.forward_mode = ForwardMode.IDLE  # an idle DP rank: no requests, an empty output
    idle = world.batch(ForwardMode.IDLE, [], [], out_cache_loc=torch.zeros(0, dtype=torch.int64))
    backend.init_forward_metadata(idle)
    empty = backend.forward(torch.zeros(0, 4 * 64, dtype=BF16), None, None, layer, idle)
    assert empty.shape == (0, 4 * 64)
    with pytest.raises(ValueError, match="fa_impl_ver"):
        world.backend(fa_impl_ver=2)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
