"""The metadata of speculative decoding with top-k > 1 (draft trees) of flashserve.sglang's
FlashAttentionBackend, filled by flashserve's operations (include/flashserve/spec_metadata.hpp:
a CPU implementation and CUDA kernels, one short launch sequence on the current stream, no
allocation, no host sync) where SGLang uses torch ops and a Triton kernel:

- draft decode's expand pass: out_cache_loc [bs, topk, num_steps] -> a page table of the
  first step_id + 1 draft slots per branch, constant lengths and their offsets;
- target verify's expand pass: per draft token, the slots of the draft tokens its custom_mask
  row shows (then the hidden ones), their count and its running sum;
- sliding-window layers under top-k > 1 verify: the prefix row then the expand row of each
  draft token concatenated by length (SGLang's prepare_swa_spec_page_table_triton), with the
  summed lengths and their offsets.

Each function writes caller-owned buffers in place (fresh tensors eagerly, the captured graph
buffers on replay) through the torch custom ops while torch.compile traces (_dispatch.call)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._dispatch import call


def new_lengths(rows: int, device: Any) -> tuple:
    """Eager length outputs: cache_seqlens int32 [rows], cu_seqlens_k int32 [rows + 1]."""
    return (torch.empty(rows, dtype=torch.int32, device=device),
            torch.empty(rows + 1, dtype=torch.int32, device=device))


def new_expand_buffers(rows: int, cols: int, device: Any) -> tuple:
    """Eager outputs of an expand pass: page_table int32 [rows, cols], then new_lengths(rows)."""
    return (torch.empty((rows, cols), dtype=torch.int32, device=device), *new_lengths(rows, device))


def draft_decode_expand(out_cache_loc: torch.Tensor, num_steps: int, decode_length: int, page_table: torch.Tensor,
                        cache_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """out_cache_loc (bs * topk * num_steps slots, [bs, topk, num_steps] in SGLang) seen as
    [bs * topk, num_steps]: page_table[r, :decode_length] = its row's first decode_length slots,
    cache_seqlens[r] = decode_length, cu_seqlens_k[r] = r * decode_length."""
    call("spec_draft_expand")(out_cache_loc.view(-1, num_steps), decode_length, page_table, cache_seqlens,
                              cu_seqlens_k)


def verify_expand(custom_mask: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                  seq_lens: torch.Tensor, num_draft_tokens: int, mask_rows: Optional[int], page_table: torch.Tensor,
                  cache_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """Draft row r = b * n + i: req_to_token[req_pool_indices[b], seq_lens[b] + j] for the
    drafts j its row of custom_mask (SGLang's per-request [n, seq_len + n] masks, flattened)
    shows, in draft order, then the hidden ones; cache_seqlens[r] = the shown count,
    cu_seqlens_k its running sum. mask_rows (graph replay of a padded batch): rows from there
    on read every mask bit from custom_mask[0], as SGLang's replay does."""
    call("spec_verify_expand")(custom_mask, req_to_token, req_pool_indices, seq_lens, num_draft_tokens, mask_rows,
                               page_table, cache_seqlens, cu_seqlens_k)


def window_page_table(page_table_a: torch.Tensor, page_table_b: torch.Tensor, seq_len_a: torch.Tensor,
                      seq_len_b: torch.Tensor, num_draft_tokens: int, page_table: torch.Tensor,
                      cache_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """Row r of page_table = the first seq_len_a[r // n] entries of page_table_a's row r // n,
    then the first seq_len_b[r] entries of page_table_b's row r (entries past a source row's
    width read 0; columns past the concatenation untouched); cache_seqlens[r] = their sum,
    cu_seqlens_k its running sum (n = num_draft_tokens)."""
    call("spec_window_page_table")(page_table_a, page_table_b, seq_len_a, seq_len_b, num_draft_tokens, page_table,
                                   cache_seqlens, cu_seqlens_k)


def prepare_swa_spec_page_table(page_table_dst: torch.Tensor, page_table_a: torch.Tensor,
                                page_table_b: torch.Tensor, seq_len_a: torch.Tensor, seq_len_b: torch.Tensor,
                                speculative_num_draft_tokens: int) -> None:
    """SGLang's prepare_swa_spec_page_table_triton (same arguments, same writes): the rows
    bs * n of page_table_dst as window_page_table writes them (its lengths discarded)."""
    bs, bs_expand = seq_len_a.numel(), seq_len_b.numel()
    if bs_expand != bs * speculative_num_draft_tokens:
        raise ValueError(f"seq_len_b: expected {bs} * {speculative_num_draft_tokens} entries, got {bs_expand}")
    lens, cu = new_lengths(bs_expand, page_table_dst.device)
    window_page_table(page_table_a, page_table_b, seq_len_a.to(torch.int32), seq_len_b.to(torch.int32),
                      speculative_num_draft_tokens, page_table_dst[:bs_expand], lens, cu)
