"""A whole engine step through the backend classes captured in a CUDA graph (as vLLM's full
CUDA graphs capture it): the metadata build outside the graph (it rewrites the builder's fixed
device buffers in place), then the layer forward (cache write + attention) inside, over static
q / key / value / out / slot_mapping / block_table buffers. Each captured batch size is replayed
over many steps with new lengths, block tables and inputs, and compared with an eager forward
of a second builder of the same config on a copy of the cache, and with the fp64 reference
(every other step padded to the captured size as engines pad: requests of length 0, slots -1):
uniform decode steps (q_len 1) and uniform verify steps (q_len 2-8), with the split count fixed
by FlashServeEngineConfig.num_splits. On the CPU the same static buffers re-run eagerly (the
fixed-buffer contract without a graph)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from flashserve.backend import (AttentionCGSupport, CommonAttentionMetadata,  # noqa: E402
                                FlashServeBackend, FlashServeEngineConfig, FlashServeImpl,
                                FlashServeKVCacheSpec, FlashServeMetadataBuilder)
from helpers_torch import DEVICES, Case, capture, check_bits, check_out  # noqa: E402
from torch_reference import attention_ref, gather_paged  # noqa: E402


@pytest.fixture
def case(request):
    return Case(request)


class Engine:
    """What an engine holds for one captured batch size: static buffers and the classes."""

    def __init__(self, case: Case, device: str, batch: int, q_len: int, cap: int, layout: str,
                 num_splits: int) -> None:
        self.case, self.device, self.batch, self.q_len, self.cap = case, device, batch, q_len, cap
        self.bs, self.H, self.Hk, self.D, self.dtype = 16, 8, 2, 128 if device == "cuda" else 64, torch.bfloat16
        self.max_blocks = -(-cap // self.bs)
        self.num_blocks = batch * self.max_blocks + 4
        FlashServeBackend.kv_cache_layout = layout
        try:
            shape = FlashServeBackend.get_kv_cache_shape(self.num_blocks, self.bs, self.Hk, self.D)
            order = FlashServeBackend.get_kv_cache_stride_order()
        finally:
            FlashServeBackend.kv_cache_layout = "NHD"
        physical = [shape[i] for i in order]
        inverse = sorted(range(5), key=lambda i: order[i])
        self.kv_cache = torch.randn(physical, generator=case.gen).to(self.dtype).to(device).permute(*inverse)
        T = batch * q_len
        self.T = T
        self.q = torch.zeros(T, self.H, self.D, dtype=self.dtype, device=device)
        self.key = torch.zeros(T, self.Hk, self.D, dtype=self.dtype, device=device)
        self.value = torch.zeros_like(self.key)
        self.out = torch.zeros_like(self.q)
        self.block_table = torch.zeros(batch, self.max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(T, dtype=torch.int64, device=device)
        self.qsl_cpu = torch.arange(0, T + 1, q_len, dtype=torch.int32)
        self.layer = types.SimpleNamespace(_k_scale=torch.tensor(1.0, device=device),
                                           _v_scale=torch.tensor(1.0, device=device))
        spec = FlashServeKVCacheSpec(block_size=self.bs, num_kv_heads=self.Hk, head_size=self.D, dtype=self.dtype)
        config = FlashServeEngineConfig(num_heads=self.H, max_num_seqs=batch, max_num_batched_tokens=T,
                                        max_model_len=cap, num_speculative_tokens=q_len - 1,
                                        enable_cascade=False, num_splits=num_splits)
        self.builders = [FlashServeMetadataBuilder(spec, ["layers.0.attn"], config, device) for _ in range(2)]
        self.impls = [FlashServeImpl(self.H, self.D, self.D ** -0.5, self.Hk, kv_cache_layout=layout,
                                     dtype=self.dtype) for _ in range(2)]
        self.md = None
        self.lens: list = []

    def new_step(self, full: bool = False, live: int = 0) -> CommonAttentionMetadata:
        """New lengths (each request's q_len newest tokens are this step's), block table and
        inputs, copied into the static buffers. live < batch: the rest are the padding an
        engine adds to reach the captured size (query and KV length 0, slots -1)."""
        case, q_len, bs = self.case, self.q_len, self.bs
        live = live or self.batch
        self.live = live
        self.lens = [self.cap if full else case.rng.randint(q_len, self.cap) for _ in range(live)]
        ids = torch.tensor(case.perm(self.num_blocks)[: self.batch * self.max_blocks], dtype=torch.int32)
        table = ids.view(self.batch, self.max_blocks)
        slots = []
        for b, n in enumerate(self.lens):
            pos = torch.arange(n - q_len, n)
            slots.append(table[b].long()[pos // bs] * bs + pos % bs)
        slots.append(torch.full(((self.batch - live) * q_len,), -1, dtype=torch.int64))
        self.block_table.copy_(table)
        self.slot_mapping.copy_(torch.cat(slots))
        for buf in (self.q, self.key, self.value):
            buf.copy_(torch.randn(buf.shape, generator=case.gen).to(self.dtype))
        sl = torch.tensor(self.lens + [0] * (self.batch - live), dtype=torch.int32)
        qsl = self.qsl_cpu.clamp(max=live * q_len)
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(self.device), query_start_loc_cpu=qsl,
            seq_lens=sl.to(self.device), seq_lens_cpu=sl, num_reqs=self.batch, num_actual_tokens=live * q_len,
            max_query_len=q_len, max_seq_len=max(self.lens), block_table_tensor=self.block_table,
            slot_mapping=self.slot_mapping)

    def forward(self, which: int) -> None:
        self.impls[which].forward(self.layer, self.q, self.key, self.value, self.kv_cache, self.md, self.out)

    def reference(self) -> torch.Tensor:
        """The live requests' rows."""
        key_cache, value_cache = self.kv_cache.unbind(0)
        ref = torch.zeros(self.live * self.q_len, self.H, self.D, device=self.device)
        for b, n in enumerate(self.lens):
            rows = slice(b * self.q_len, (b + 1) * self.q_len)
            k = gather_paged(key_cache, self.block_table[b], n)
            v = gather_paged(value_cache, self.block_table[b], n)
            ref[rows] = attention_ref(self.q[rows], k, v, scale=self.D ** -0.5, causal=True)[0]
        return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len", [1, 2, 5, 8], ids=lambda n: f"q_len{n}")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_backend_step_graph_replay(case, device, q_len, layout):
    assert FlashServeMetadataBuilder.get_cudagraph_support(None, None) >= AttentionCGSupport.UNIFORM_BATCH
    sizes, cap, steps = ([1, 3, 8], 1024, 8) if device == "cuda" else ([3], 96, 4)
    for batch in sizes:
        e = Engine(case, device, batch, q_len, cap, layout, num_splits=4)
        case.desc = f"batch={batch} q_len={q_len} {layout}"
        # capture with the longest lengths: the captured split count is the config's
        e.md = e.builders[0].build_for_cudagraph_capture(e.new_step(full=True))
        assert e.md.num_decodes == batch and e.md.num_decode_tokens == e.T, case.where()
        graph = capture(lambda: e.forward(0), device)
        for step in range(steps):
            common = e.new_step(live=batch if step % 2 == 0 else case.rng.randint(1, batch))
            case.desc = f"batch={batch} q_len={q_len} {layout} step {step}: live lens={e.lens}"
            e.md = e.builders[0].build(0, common)  # outside the graph: rewrites its buffers in place
            before = e.kv_cache.clone()
            e.out.fill_(float("nan"))
            graph.replay()
            if device == "cuda":
                torch.cuda.synchronize()
            rows = e.live * q_len
            replayed, cache_replayed = e.out[:rows].clone(), e.kv_cache.clone()
            check_out(case, "replayed out", replayed, e.reference(), cap)

            e.kv_cache.copy_(before)  # the same step eagerly through the second builder
            e.md = e.builders[1].build(0, common)
            e.out.fill_(float("nan"))
            e.forward(1)
            check_bits(case, "cache written by the replay vs eager", cache_replayed, e.kv_cache)
            check_out(case, "replayed vs eager", replayed, e.out[:rows].float(), cap)


@pytest.mark.skipif("cuda" not in DEVICES, reason="a long CUDA-graph replay needs CUDA")
@pytest.mark.parametrize("q_len", [1, 4], ids=lambda n: f"q_len{n}")
def test_backend_step_graph_replay_1000_steps(case, q_len):
    """vLLM's use: one captured decode (q_len 1) or uniform verify (q_len 4) step of 8 requests,
    replayed over 1000 steps with new lengths, block tables, inputs and batch padding, and
    bitwise equal to the eager step every time (the captured split count is the config's, so
    the eager call runs the same kernels); the fp64 reference every 100th step."""
    batch, cap = 8, 1024
    e = Engine(case, "cuda", batch, q_len, cap, "NHD", num_splits=4)
    e.md = e.builders[0].build_for_cudagraph_capture(e.new_step(full=True))
    graph = capture(lambda: e.forward(0), "cuda")
    for step in range(1000):
        common = e.new_step(live=batch if step % 3 else case.rng.randint(1, batch))
        case.desc = f"q_len={q_len} step {step}: live lens={e.lens}"
        e.md = e.builders[0].build(0, common)
        before = e.kv_cache.clone()
        e.out.fill_(float("nan"))
        graph.replay()
        rows = e.live * q_len
        replayed, cache_replayed = e.out[:rows].clone(), e.kv_cache.clone()
        if step % 100 == 0:
            check_out(case, "replayed out", replayed, e.reference(), cap)
        e.kv_cache.copy_(before)
        e.md = e.builders[1].build(0, common)
        e.out.fill_(float("nan"))
        e.forward(1)
        check_bits(case, "replayed out vs eager", replayed, e.out[:rows])
        check_bits(case, "cache written by the replay vs eager", cache_replayed, e.kv_cache)


@pytest.mark.parametrize("batch", [1, 6])
def test_fixed_split_count_config(case, batch):
    """num_splits fixes every decode plan's split count whatever the batch (capped by the keys'
    granules only); it is checked like the engine's other limits."""
    e = Engine(case, "cpu", batch, 1, 512, "NHD", num_splits=3)
    md = e.builders[0].build(0, e.new_step(full=True))
    assert md.handle.decode_num_splits == 3, case.where()
    spec = FlashServeKVCacheSpec(block_size=16, num_kv_heads=2, head_size=64)
    with pytest.raises(ValueError, match="num_splits"):
        FlashServeMetadataBuilder(spec, ["l"], FlashServeEngineConfig(num_heads=8, num_splits=-1))
    with pytest.raises(ValueError, match="num_splits"):
        FlashServeMetadataBuilder(spec, ["l"], FlashServeEngineConfig(num_heads=8, num_splits=1000))
