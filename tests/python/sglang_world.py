"""The SGLang world of test_sglang_backend.py: duck-typed stand-ins for SGLang's model runner,
req_to_token pool, KV pools (MHA, MLA), RadixAttention layer and ForwardBatch (World builds them as
SGLang does), the batch builders of each forward mode (extend, speculative verify trees, draft
decode, CUDA graph steps) and the references the tests compare with."""

from __future__ import annotations

import enum

import torch

import flashserve
from flashserve.sglang import FlashAttentionBackend

from helpers_torch import Case, check_bits, check_out, poisoned
from torch_reference import attention_ref

BF16 = torch.bfloat16
CUDA = torch.cuda.is_available() and flashserve.WITH_CUDA


# ----------------------------------------------------------------------------- SGLang stand-ins

class ForwardMode(enum.IntEnum):
    """sglang.srt.model_executor.forward_batch_info.ForwardMode (the members used here)."""
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()
    SPLIT_PREFILL = enum.auto()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


class AttentionArch(enum.Enum):
    MLA = enum.auto()
    MHA = enum.auto()


class NS:
    """A namespace with the given attributes (ForwardBatch, spec_info, configs)."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class ReqToTokenPool:
    def __init__(self, max_reqs: int, context_len: int, device: str) -> None:
        self.req_to_token = torch.zeros(max_reqs, context_len, dtype=torch.int32, device=device)


class MHATokenToKVPool:
    """Per-layer buffers [size, H_kv, D]; set_kv_buffer writes rows at loc."""

    def __init__(self, size: int, heads_kv: int, d: int, dv: int, dtype, device: str, layers: int = 1) -> None:
        self.k_buffer = [poisoned((size, heads_kv, d), dtype, device) for _ in range(layers)]
        self.v_buffer = [poisoned((size, heads_kv, dv), dtype, device) for _ in range(layers)]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None) -> None:
        dtype = self.k_buffer[0].dtype
        if cache_k.dtype != dtype:  # fp8 caches store x / scale
            if k_scale is not None:
                cache_k = cache_k / k_scale
            if v_scale is not None:
                cache_v = cache_v / v_scale
        self.k_buffer[layer.layer_id][loc] = cache_k.to(dtype)
        self.v_buffer[layer.layer_id][loc] = cache_v.to(dtype)

    def get_kv_buffer(self, layer_id: int):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def fill(self, case: Case, slots: torch.Tensor) -> None:
        for buf in self.k_buffer + self.v_buffer:
            buf[slots.long()] = case.randn(slots.numel(), *buf.shape[1:], dtype=buf.dtype, device=buf.device)


class MLATokenToKVPool:
    """Per-layer latent buffers [size, 1, kv_lora_rank + rope]."""

    def __init__(self, size: int, width: int, dtype, device: str, layers: int = 1) -> None:
        self.kv_buffer = [poisoned((size, 1, width), dtype, device) for _ in range(layers)]

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope) -> None:
        self.kv_buffer[layer.layer_id][loc] = torch.cat([cache_k_nope, cache_k_rope], dim=-1).to(
            self.kv_buffer[0].dtype)

    def get_key_buffer(self, layer_id: int):
        return self.kv_buffer[layer_id]

    def fill(self, case: Case, slots: torch.Tensor) -> None:
        for buf in self.kv_buffer:
            buf[slots.long()] = case.randn(slots.numel(), *buf.shape[1:], dtype=buf.dtype, device=buf.device)


def radix_layer(heads: int, heads_kv: int, d: int, dv: int | None = None, *, layer_id: int = 0,
                window: int = -1, cross: bool = False, irope: bool = False, logit_cap: float = 0.0,
                scaling: float | None = None) -> NS:
    """RadixAttention's attributes (sliding_window_size is already w - 1 in SGLang)."""
    return NS(layer_id=layer_id, tp_q_head_num=heads, tp_k_head_num=heads_kv, tp_v_head_num=heads_kv,
              head_dim=d, v_head_dim=d if dv is None else dv, scaling=d ** -0.5 if scaling is None else scaling,
              logit_cap=logit_cap, sliding_window_size=window, is_cross_attention=cross, k_scale=None,
              v_scale=None, use_irope=irope)


class World:
    """A model runner with its pools: requests get random pages (page 0 is SGLang's padding
    page and is never handed out); owned slots hold random K/V, the others NaN."""

    def __init__(self, case: Case, device: str, *, page_size: int = 1, heads_kv: int = 2, d: int = 64,
                 dv: int | None = None, mla: bool = False, context_len: int = 128, max_reqs: int = 8,
                 topk: int = 0, n_draft: int | None = None, swa: int | None = None, chunk: int | None = None,
                 encdec: bool = False, dtype=BF16) -> None:
        self.case, self.device, self.page_size, self.dtype = case, device, page_size, dtype
        num_pages = max_reqs * (context_len // page_size + 1) + 64
        self.size = num_pages * page_size
        self.free_pages = [p + 1 for p in case.perm(num_pages - 1)]
        self.free_reqs = case.perm(max_reqs)
        self.req_pool = ReqToTokenPool(max_reqs, context_len, device)
        if mla:
            self.kv_pool = MLATokenToKVPool(self.size, d, dtype, device)
        else:
            self.kv_pool = MHATokenToKVPool(self.size, heads_kv, d, d if dv is None else dv, dtype, device)
        self.runner = NS(
            device=device, page_size=page_size, sliding_window_size=swa, is_hybrid=False,
            model_config=NS(context_len=context_len, attention_arch=AttentionArch.MLA if mla else AttentionArch.MHA,
                            is_encoder_decoder=encdec),
            server_args=NS(kv_cache_dtype="auto", speculative_eagle_topk=topk or None,
                           speculative_num_draft_tokens=n_draft, enable_deterministic_inference=False),
            kv_cache_dtype=dtype, req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool)
        if chunk is not None:
            self.runner.attention_chunk_size = chunk

    def new_request(self, length: int, filled: int) -> int:
        """A request slot whose first `length` tokens have slots; the first `filled` hold K/V."""
        r = self.free_reqs.pop()
        n_pages = -(-length // self.page_size)
        pages = torch.tensor([self.free_pages.pop() for _ in range(n_pages)], dtype=torch.int64)
        t = torch.arange(n_pages * self.page_size)
        slots = pages[t // self.page_size] * self.page_size + t % self.page_size
        self.req_pool.req_to_token[r, :slots.numel()] = slots.to(torch.int32).to(self.device)
        if filled:
            self.kv_pool.fill(self.case, slots[:filled].to(self.device))
        return r

    def new_slots(self, n: int, filled: bool) -> torch.Tensor:
        """n token slots outside every request's req_to_token row (draft branches of top-k > 1)."""
        assert self.page_size == 1
        slots = torch.tensor([self.free_pages.pop() for _ in range(n)], dtype=torch.int64, device=self.device)
        if filled:
            self.kv_pool.fill(self.case, slots)
        return slots

    def slots(self, r: int, lo: int, hi: int) -> torch.Tensor:
        return self.req_pool.req_to_token[r, lo:hi].long()

    def backend(self, **kw) -> FlashAttentionBackend:
        return FlashAttentionBackend(self.runner, **kw)

    def batch(self, mode: ForwardMode, reqs: list[int], seq_lens: list[int], **kw) -> NS:
        """A ForwardBatch as SGLang's ScheduleBatch / ModelWorkerBatch produce it."""
        dev = self.device
        fb = NS(forward_mode=mode, batch_size=len(reqs),
                req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
                seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64), seq_lens_sum=sum(seq_lens),
                out_cache_loc=None, extend_prefix_lens=None, extend_prefix_lens_cpu=None, extend_seq_lens=None,
                extend_seq_lens_cpu=None, spec_info=None, encoder_lens=None, encoder_out_cache_loc=None,
                attn_attend_prefix_cache=None, mha_return_lse=False, req_to_token_pool=self.req_pool,
                token_to_kv_pool=self.kv_pool)
        fb.__dict__.update(kw)
        return fb

    def k_rows(self, slots: torch.Tensor, layer_id: int = 0) -> torch.Tensor:
        return self.kv_pool.k_buffer[layer_id][slots.long()].float()

    def v_rows(self, slots: torch.Tensor, layer_id: int = 0) -> torch.Tensor:
        return self.kv_pool.v_buffer[layer_id][slots.long()].float()


def extend_batch(world: World, mode: ForwardMode, prefix: list[int], ext: list[int]) -> NS:
    """EXTEND / MIXED / DRAFT_EXTEND: request b has prefix[b] cached tokens and ext[b] new ones."""
    dev = world.device
    reqs = [world.new_request(p + e, p) for p, e in zip(prefix, ext)]
    seq = [p + e for p, e in zip(prefix, ext)]
    loc = torch.cat([world.slots(r, p, p + e) for r, p, e in zip(reqs, prefix, ext)])
    return world.batch(mode, reqs, seq, out_cache_loc=loc,
                       extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev),
                       extend_prefix_lens_cpu=list(prefix),
                       extend_seq_lens=torch.tensor(ext, dtype=torch.int32, device=dev), extend_seq_lens_cpu=list(ext),
                       positions=None)


def new_kv(world: World, n: int, layer: NS) -> tuple:
    return (world.case.randn(n, layer.tp_k_head_num, layer.head_dim, dtype=world.dtype, device=world.device),
            world.case.randn(n, layer.tp_v_head_num, layer.v_head_dim, dtype=world.dtype, device=world.device))


def check_written(case: Case, world: World, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_bits(case, "k written at out_cache_loc", world.kv_pool.k_buffer[0][loc.long()], k)
    check_bits(case, "v written at out_cache_loc", world.kv_pool.v_buffer[0][loc.long()], v)


def ref_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: NS, **kw) -> torch.Tensor:
    out, _ = attention_ref(q, keys, values, scale=layer.scaling, softcap=layer.logit_cap, **kw)
    return out


def lens(case: Case, n: int, lo: int, hi: int) -> list[int]:
    return [case.rng.randint(lo, hi) for _ in range(n)]


def draft_tree(case: Case, n: int) -> list[list[bool]]:
    """A random draft tree over n tokens (token 0 the root, parent[i] < i): visible[i][j] when j
    is i or one of its ancestors."""
    parent = [-1] + [case.rng.randint(0, i - 1) for i in range(1, n)]
    vis = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            vis[i][j] = True
            j = parent[j]
    return vis


def custom_mask(prefix: list[int], trees: list[list[list[bool]]], device: str) -> torch.Tensor:
    """SGLang's flattened verify mask: per request [n_draft, prefix + n_draft], prefix columns set."""
    rows = []
    for p, vis in zip(prefix, trees):
        for row in vis:
            rows.append(torch.tensor([True] * p + row))
    return torch.cat(rows).to(device)


def verify_tree_batch(case: Case, world: World, n_draft: int, batch: int) -> tuple:
    prefix = lens(case, batch, 1, 40)
    reqs = [world.new_request(p + n_draft, p) for p in prefix]
    loc = torch.cat([world.slots(r, p, p + n_draft) for r, p in zip(reqs, prefix)])
    trees = [draft_tree(case, n_draft) for _ in range(batch)]
    spec = NS(draft_token_num=n_draft, topk=world.runner.server_args.speculative_eagle_topk,
              custom_mask=custom_mask(prefix, trees, world.device),
              positions=torch.zeros(batch * n_draft, dtype=torch.int64, device=world.device))
    fb = world.batch(ForwardMode.TARGET_VERIFY, reqs, prefix, out_cache_loc=loc, spec_info=spec)
    return fb, reqs, prefix, trees


def check_verify_tree(case: Case, world: World, out: torch.Tensor, q: torch.Tensor, layer: NS, reqs, prefix,
                      trees, n_draft: int) -> None:
    heads, d = layer.tp_q_head_num, layer.head_dim
    window = layer.sliding_window_size
    for b, (r, p) in enumerate(zip(reqs, prefix)):
        for i in range(n_draft):
            seen = [j for j in range(n_draft) if trees[b][i][j]]
            slots = torch.cat([world.slots(r, 0, p), world.slots(r, p, p + n_draft)[seen]])
            t = b * n_draft + i
            ref = ref_rows(q[t].view(1, heads, d), world.k_rows(slots), world.v_rows(slots), layer,
                           causal=True, window=(window, 0))
            check_out(case, f"request {b} draft {i} (sees {seen})", out[t].view(1, heads, d), ref)


def draft_decode_batch(case: Case, world: World, topk: int, steps: int, step: int, batch: int) -> tuple:
    """The EAGLE draft worker's decode step `step`: bs * topk branches, each with `steps` draft
    slots (out_cache_loc [bs, topk, steps]); steps < step already hold K/V."""
    prefix = lens(case, batch, 1, 40)
    reqs = [world.new_request(p, p) for p in prefix]
    loc = world.new_slots(batch * topk * steps, filled=False).view(batch, topk, steps)
    if step:
        world.kv_pool.fill(case, loc[:, :, :step].reshape(-1))
    spec = NS(topk=topk, draft_token_num=steps)
    fb = world.batch(ForwardMode.DECODE, reqs, prefix, out_cache_loc=loc.reshape(-1), spec_info=spec)
    return fb, reqs, prefix, loc


def mla_ref(q_nope, q_rope, latent, layer) -> torch.Tensor:
    """Absorbed MLA: score = q_rope·k_rope + q_nope·c_kv, out = Σ p c_kv."""
    c_kv, k_rope = latent[:, :, :layer.v_head_dim], latent[:, :, layer.v_head_dim:]
    out, _ = attention_ref(q_rope, k_rope, c_kv, q_v=q_nope, scale=layer.scaling, causal=True)
    return out


GRAPH_MODES = ["decode", "decode_local", "verify_topk1", "verify_tree", "verify_tree_swa", "draft_topk1",
               "draft_topk", "draft_extend", "encdec_self", "encdec_cross"]
UNPADDED = ("draft_extend",)  # replays at the captured batch size only (accept_length per request)


class GraphStep:
    """One step of a graph mode: a batch of bs requests with fresh contents, its replay
    arguments, its inputs (q, k, v), and the expected output."""

    def __init__(self, case: Case, world: World, kind: str, bs: int, layer: NS, steps: int, step: int) -> None:
        dev = world.device
        self.kind, self.bs = kind, bs
        heads, d = layer.tp_q_head_num, layer.head_dim
        n_draft = world.runner.server_args.speculative_num_draft_tokens
        self.spec = None
        self.out_cache_loc = None
        self.encoder_lens = None
        expected_keys = []  # per query row: slots it sees, causal window
        if kind.startswith("encdec"):  # req_to_token: encoder tokens, then decoder tokens
            enc, seq = lens(case, bs, 1, 20), lens(case, bs, 1, 30)
            reqs = [world.new_request(e + n, e + n - 1) for e, n in zip(enc, seq)]
            self.loc = torch.stack([world.slots(r, e + n - 1, e + n)[0] for r, e, n in zip(reqs, enc, seq)])
            self.mode = ForwardMode.DECODE
            self.encoder_lens = torch.tensor(enc, dtype=torch.int32, device=dev)
            for r, e, n in zip(reqs, enc, seq):
                expected_keys.append(world.slots(r, 0, e) if kind == "encdec_cross" else world.slots(r, e, e + n))
            rows = bs
        elif kind in ("decode", "decode_local"):
            seq = lens(case, bs, 8 if kind == "decode_local" else 1, 60)
            reqs = [world.new_request(n, n - 1) for n in seq]
            self.loc = torch.stack([world.slots(r, n - 1, n)[0] for r, n in zip(reqs, seq)])
            self.mode = ForwardMode.DECODE
            for r, n in zip(reqs, seq):
                expected_keys.append(world.slots(r, 0, n))
            rows = bs
        elif kind == "verify_topk1":
            seq = lens(case, bs, 1, 50)
            reqs = [world.new_request(p + n_draft, p) for p in seq]
            self.loc = torch.cat([world.slots(r, p, p + n_draft) for r, p in zip(reqs, seq)])
            self.mode = ForwardMode.TARGET_VERIFY
            self.spec = NS(draft_token_num=n_draft, custom_mask=None)
            for r, p in zip(reqs, seq):
                for i in range(n_draft):
                    expected_keys.append(world.slots(r, 0, p + i + 1))
            rows = bs * n_draft
        elif kind.startswith("verify_tree"):
            fb, reqs, seq, trees = verify_tree_batch(case, world, n_draft, bs)
            self.loc, self.spec, self.mode = fb.out_cache_loc, fb.spec_info, ForwardMode.TARGET_VERIFY
            for b, (r, p) in enumerate(zip(reqs, seq)):
                for i in range(n_draft):
                    seen = [j for j in range(n_draft) if trees[b][i][j]]
                    expected_keys.append(torch.cat([world.slots(r, 0, p), world.slots(r, p, p + n_draft)[seen]]))
            rows = bs * n_draft
        elif kind == "draft_topk1":
            seq = lens(case, bs, 1, 40)
            reqs = [world.new_request(p + steps, p + step) for p in seq]
            self.loc = torch.stack([world.slots(r, p + step, p + step + 1)[0] for r, p in zip(reqs, seq)])
            self.mode, self.spec = ForwardMode.DECODE, NS(topk=1)
            for r, p in zip(reqs, seq):
                expected_keys.append(world.slots(r, 0, p + step + 1))
            rows = bs
        elif kind == "draft_extend":  # the draft model's extend over each request's accepted tokens
            per = n_draft
            counts = [case.rng.randint(1, per) for _ in range(bs)]
            seq = [max(n, c) for n, c in zip(lens(case, bs, 1, 50), counts)]
            reqs = [world.new_request(n, n - c) for n, c in zip(seq, counts)]
            self.loc = torch.cat([world.slots(r, n - c, n) for r, n, c in zip(reqs, seq, counts)])
            self.mode = ForwardMode.DRAFT_EXTEND
            self.spec = NS(accept_length=torch.tensor(counts, dtype=torch.int32, device=dev),
                           accept_length_cpu=[c - 1 for c in counts])
            for r, n, c in zip(reqs, seq, counts):
                for i in range(c):
                    expected_keys.append(world.slots(r, 0, n - c + i + 1))
            rows = sum(counts)
            self.graph_rows = bs * per
        else:  # draft_topk
            topk = world.runner.server_args.speculative_eagle_topk
            fb, reqs, seq, loc = draft_decode_batch(case, world, topk, steps, step, bs)
            self.out_cache_loc, self.spec, self.mode = fb.out_cache_loc, fb.spec_info, ForwardMode.DECODE
            self.loc = loc[:, :, step].reshape(-1)
            for b, (r, p) in enumerate(zip(reqs, seq)):
                for j in range(topk):
                    expected_keys.append(torch.cat([world.slots(r, 0, p), loc[b, j, :step + 1]]))
            rows = bs * topk
        self.reqs, self.seq = reqs, seq
        if kind != "draft_extend":
            self.graph_rows = rows
        self.q = case.randn(rows, heads * d, dtype=BF16, device=dev)
        self.k, self.v = new_kv(world, rows, layer)
        self.keys = expected_keys
        self.window = layer.sliding_window_size
        if kind == "encdec_cross":  # the encoder's K/V is cached: cross attention appends nothing
            self.k = self.v = None
        self.fb = world.batch(self.mode, reqs, seq, out_cache_loc=self.loc, spec_info=self.spec,
                              encoder_lens=self.encoder_lens)

    def replay(self, backend: FlashAttentionBackend, max_bs: int, graph_bs: int | None = None) -> None:
        """SGLang's cuda graph runner pads req_pool_indices (0) / seq_lens (the fill value of
        get_cuda_graph_seq_len_fill_value) to its buffers' size and replays the captured batch
        size graph_bs >= the real batch."""
        dev = self.q.device
        fill = backend.get_cuda_graph_seq_len_fill_value()
        pad = max_bs - self.bs
        rpi = torch.cat([torch.tensor(self.reqs, dtype=torch.int64), torch.zeros(pad, dtype=torch.int64)]).to(dev)
        seq_cpu = torch.cat([torch.tensor(self.seq, dtype=torch.int64), torch.full((pad,), fill)])
        enc = None
        if self.encoder_lens is not None:
            enc = torch.cat([self.encoder_lens, self.encoder_lens.new_zeros(pad)])
        backend.init_forward_metadata_replay_cuda_graph(graph_bs or self.bs, rpi, seq_cpu.to(dev), int(seq_cpu.sum()),
                                                        enc, self.mode, self.spec, seq_cpu,
                                                        out_cache_loc=self.out_cache_loc)

    def padded(self, graph_bs: int) -> tuple:
        """(q, k, v, out_cache_loc) with the padded requests' rows (zeros; slot 0, SGLang's
        padding slot) after the real ones, and the ForwardBatch over them."""
        per = self.graph_rows // self.bs
        extra = graph_bs * per - self.q.shape[0]

        def pad(x, value=0):
            return None if x is None else torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])

        q, k, v, loc = pad(self.q), pad(self.k), pad(self.v), pad(self.loc)
        fb = NS(**self.fb.__dict__)
        fb.out_cache_loc, fb.batch_size = loc, graph_bs
        return q, k, v, loc, fb

    def check(self, case: Case, world: World, out: torch.Tensor, layer: NS, what: str) -> None:
        heads, d = layer.tp_q_head_num, layer.head_dim
        for t, slots in enumerate(self.keys):
            chunk = world.runner.attention_chunk_size if self.kind == "decode_local" else 0
            ref = ref_rows(self.q[t].view(1, heads, d), world.k_rows(slots), world.v_rows(slots), layer,
                           causal=True, window=(self.window, 0), chunk=chunk)
            check_out(case, f"{what} row {t}", out[t].view(1, heads, d), ref)


def graph_world(case: Case, device: str, kind: str, steps: int) -> tuple:
    page_size = 4 if kind in ("decode", "verify_topk1", "draft_topk1") else 1
    window = case.rng.randint(1, 8) if kind == "verify_tree_swa" else -1
    topk = {"verify_tree": 2, "verify_tree_swa": 2, "draft_topk": 2, "verify_topk1": 1, "draft_topk1": 1,
            "draft_extend": 1}.get(kind, 0)
    n_draft = {"verify_topk1": 3, "verify_tree": 4, "verify_tree_swa": 4, "draft_topk1": steps + 1,
               "draft_topk": steps * 2, "draft_extend": 4}.get(kind)
    world = World(case, device, page_size=page_size, topk=topk, n_draft=n_draft,
                  swa=window if kind == "verify_tree_swa" else None, chunk=8 if kind == "decode_local" else None,
                  max_reqs=32, context_len=128)
    if kind.startswith("encdec"):
        world = World(case, device, encdec=True, max_reqs=32, context_len=128)
    layer = radix_layer(4, 2, 64, window=window, irope=kind == "decode_local", cross=kind == "encdec_cross")
    return world, layer


def _graph_backend(world: World, kind: str, steps: int, step: int) -> FlashAttentionBackend:
    if kind in ("draft_topk", "draft_topk1"):
        return world.backend(speculative_step_id=step, topk=world.runner.server_args.speculative_eagle_topk,
                             speculative_num_steps=steps)
    return world.backend()
