"""One decode step of a serving engine with flashserve: a paged KV cache, the new token's K/V
written with reshape_and_cache_flash, then attention over the cache with
flash_attn_varlen_func (vLLM's call) and flash_attn_with_kvcache (SGLang's / FlashAttention's),
checked against a plain torch computation.

    python examples/python/decode_step.py            # CUDA when available, else the CPU
    python examples/python/decode_step.py --device cpu
"""

from __future__ import annotations

import argparse

import torch

import flashserve


def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
    """vLLM's layout: one tensor (2, num_blocks, block_size, H_kv, D); K and V are views."""
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    return kv[0], kv[1]


def reference(q, k_cache, v_cache, block_table, seq_lens, block_size):
    """Attention of each sequence's single query over its cached tokens, in fp32."""
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_table[b, :-(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float()  # [n, H_kv, D]
        v = v_cache[blocks].flatten(0, 1)[:n].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device, dtype = args.device, torch.bfloat16
    batch, heads, kv_heads, head_dim, block_size, max_blocks = 4, 16, 4, 128, 16, 8

    k_cache, v_cache = make_cache(batch * max_blocks, block_size, kv_heads, head_dim, dtype, device)
    block_table = torch.randperm(batch * max_blocks, device=device).to(torch.int32).view(batch, max_blocks)
    lens = [17, 64, 3, 100]  # KV lengths after this step (the engine knows them on the host)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)

    # This step's tokens: q, and the new K/V written at position seq_len - 1 of each sequence.
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    k_new = torch.randn(batch, kv_heads, head_dim, dtype=dtype, device=device)
    v_new = torch.randn(batch, kv_heads, head_dim, dtype=dtype, device=device)
    pos = (seq_lens - 1).long()
    slot_mapping = block_table[torch.arange(batch, device=device), pos // block_size].long() * block_size \
        + pos % block_size
    scale = torch.tensor(1.0, device=device)
    flashserve.reshape_and_cache_flash(k_new, v_new, k_cache, v_cache, slot_mapping, "auto", scale, scale)

    # vLLM: varlen call, one query per sequence.
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    flashserve.flash_attn_varlen_func(q, k_cache, v_cache, 1, cu_seqlens_q, max(lens),
                                      seqused_k=seq_lens, block_table=block_table, causal=True, out=out)

    # SGLang / FlashAttention: batched call, q [B, 1, H, D], with the LSE [B, H, 1].
    out2, lse = flashserve.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=seq_lens,
                                                   block_table=block_table, causal=True, return_softmax_lse=True)

    want = reference(q, k_cache, v_cache, block_table, seq_lens, block_size)
    err = (out.float() - want).abs().max().item()
    err2 = (out2.squeeze(1).float() - want).abs().max().item()
    print(f"decode step on {device}: out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)}; "
          f"max |out - ref| varlen {err:.2e}, kvcache {err2:.2e}")
    assert err < 3e-2 and err2 < 3e-2, "mismatch against the reference"


if __name__ == "__main__":
    main()
