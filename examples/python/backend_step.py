"""An engine-like loop through flashserve's backend classes (FlashServeBackend, its metadata
builder and layer impl): a paged KV cache allocated from the backend's shape and stride order,
a block allocator, requests that arrive, prefill and decode, one metadata build per step and one
forward per layer. The last step is checked against a plain torch computation.

    python examples/python/backend_step.py [--device cuda] [--layout HND]
"""

from __future__ import annotations

import argparse
import time
import types
from dataclasses import dataclass, field

import torch

from flashserve.backend import (CommonAttentionMetadata, FlashServeBackend, FlashServeEngineConfig,
                                FlashServeKVCacheSpec, reorder_decodes_first)


@dataclass
class Request:
    prompt_len: int
    num_computed: int = 0                      # tokens already in the KV cache
    blocks: list[int] = field(default_factory=list)


class ToyEngine:
    """Just enough of an engine to drive the backend: caches, blocks, batches."""

    def __init__(self, device: str, layout: str, num_layers: int = 2, heads: int = 8, kv_heads: int = 2,
                 head_size: int = 64, block_size: int = 16, num_blocks: int = 128) -> None:
        backend = FlashServeBackend
        backend.kv_cache_layout = layout
        self.device, self.block_size = device, block_size
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, head_size
        self.dtype = torch.float32 if device == "cpu" else torch.bfloat16
        shape = backend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size)
        order = backend.get_kv_cache_stride_order()
        inverse = sorted(range(len(order)), key=lambda i: order[i])
        physical = [shape[i] for i in order]
        self.kv_caches = [torch.zeros(physical, dtype=self.dtype, device=device).permute(*inverse)
                          for _ in range(num_layers)]
        spec = FlashServeKVCacheSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size,
                                     dtype=self.dtype)
        self.config = FlashServeEngineConfig(num_heads=heads, max_num_seqs=32, max_num_batched_tokens=1024,
                                             max_model_len=1024)
        names = [f"model.layers.{i}.attn" for i in range(num_layers)]
        self.builder = backend.get_builder_cls()(spec, names, self.config, device)
        self.impls = [backend.get_impl_cls()(heads, head_size, head_size ** -0.5, kv_heads, dtype=self.dtype)
                      for _ in names]
        self.layers = [types.SimpleNamespace(_k_scale=torch.ones((), device=device),
                                             _v_scale=torch.ones((), device=device)) for _ in names]
        self.free = list(range(num_blocks))
        self.block_table = torch.zeros(self.config.max_num_seqs, self.config.max_model_len // block_size,
                                       dtype=torch.int32)
        self.requests: dict[str, Request] = {}

    def common_metadata(self, batch: list[tuple[str, int]]) -> CommonAttentionMetadata:
        """Blocks for the new tokens, then the step's batch description (decodes first)."""
        qlens = torch.tensor([n for _, n in batch], dtype=torch.int32)
        batch = [batch[i] for i in reorder_decodes_first(qlens, self.builder.reorder_batch_threshold)]
        starts, seq_lens, slots = [0], [], []
        for row, (rid, n) in enumerate(batch):
            req = self.requests[rid]
            end = req.num_computed + n
            while len(req.blocks) * self.block_size < end:
                req.blocks.append(self.free.pop())
            self.block_table[row, :len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
            slots += [req.blocks[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(req.num_computed, end)]
            starts.append(starts[-1] + n)
            seq_lens.append(end)
        qsl, lens = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
        self.order = batch
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(self.device), query_start_loc_cpu=qsl, seq_lens=lens.to(self.device),
            seq_lens_cpu=lens, num_reqs=len(batch), num_actual_tokens=starts[-1],
            max_query_len=int(qlens.max()), max_seq_len=max(seq_lens),
            block_table_tensor=self.block_table[:len(batch)].to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device))

    def step(self, batch: list[tuple[str, int]]) -> tuple:
        """One step: build once, then every layer's forward on fresh projections."""
        cm = self.common_metadata(batch)
        t0 = time.perf_counter()
        md = self.builder.build(0, cm)
        t1 = time.perf_counter()
        tokens = cm.num_actual_tokens
        for impl, layer, kv_cache in zip(self.impls, self.layers, self.kv_caches):
            q = torch.randn(tokens, self.heads, self.head_size, device=self.device).to(self.dtype)
            k = torch.randn(tokens, self.kv_heads, self.head_size, device=self.device).to(self.dtype)
            v = torch.randn(tokens, self.kv_heads, self.head_size, device=self.device).to(self.dtype)
            out = torch.empty(tokens, self.heads, self.head_size, dtype=self.dtype, device=self.device)
            impl.forward(layer, q, k, v, kv_cache, md, out)
        if self.device != "cpu":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        for rid, n in self.order:
            self.requests[rid].num_computed += n
        return md, (q, out), (t1 - t0) * 1e6, (t2 - t1) * 1e6

    def check_last_layer(self, q: torch.Tensor, out: torch.Tensor) -> float:
        """Max |out - plain torch attention| of the last layer over the last step's batch."""
        key_cache, value_cache = self.kv_caches[-1].unbind(0)
        group, err, row = self.heads // self.kv_heads, 0.0, 0
        for rid, n in self.order:
            req = self.requests[rid]
            pos = torch.arange(req.num_computed)
            slot_blocks = torch.tensor(req.blocks)[pos // self.block_size]
            k = key_cache[slot_blocks, pos % self.block_size].float().repeat_interleave(group, 1)
            v = value_cache[slot_blocks, pos % self.block_size].float().repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q[row:row + n].float(), k) * self.head_size ** -0.5
            qpos = torch.arange(req.num_computed - n, req.num_computed)
            future = (pos[None, :] > qpos[:, None]).to(s.device)
            s = s.masked_fill(future[None], float("-inf"))
            ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
            err = max(err, (out[row:row + n].float() - ref).abs().max().item())
            row += n
        return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layout", default="NHD", choices=["NHD", "HND"])
    args = parser.parse_args()
    engine = ToyEngine(args.device, args.layout)
    schedule = [  # (request, new tokens) per step: prompts arrive, then decode
        {"a": 40, "b": 23},
        {"a": 1, "b": 1, "c": 57},
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "b": 1, "c": 1, "d": 9},
        {"a": 1, "b": 1, "c": 1, "d": 1},
    ]
    for step, batch in enumerate(schedule):
        for rid, n in batch.items():
            engine.requests.setdefault(rid, Request(prompt_len=n))
        md, (q, out), build_us, fwd_us = engine.step(list(batch.items()))
        print(f"step {step}: {md.num_reqs} requests ({md.num_decodes} decode, {md.num_prefills} prefill), "
              f"{md.num_actual_tokens} tokens, cascade={md.use_cascade}; build {build_us:.0f} us, "
              f"{len(engine.impls)} layers {fwd_us:.0f} us")
    print(f"last step vs plain torch: max |diff| = {engine.check_last_layer(q, out):.2e}")


if __name__ == "__main__":
    main()
