"""A straightforward torch reference of flashserve's operations, written from SPEC.md.

Attention is computed per sequence with dense masks in float64 on the inputs' device and
returned as float32, so it serves as the fp32 oracle for the CPU reference and the CUDA kernels
alike (no TF32, no reduced-precision matmul). Operands are passed already decoded to float
(fp8 caches times their descales): callers round inputs first, then compare.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  causal: bool = False, window: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, alibi: torch.Tensor | None = None,
                  sink: torch.Tensor | None = None, chunk: int = 0,
                  q_v: torch.Tensor | None = None,
                  alibi_sqrt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC.md §2 for one sequence: q [sq, H, D], k [sk, H_kv, D], v [sk, H_kv, Dv].

    alibi: slopes [H] (alibi_sqrt: over sqrt of the distance); sink: logits [H]; chunk > 0:
    chunked local attention (j and i' in the same chunk); q_v [sq, H, Dv]: adds q_v·v_j to the
    score. Returns out [sq, H, Dv] and lse [H, sq], float32.
    """
    sq, heads, _ = q.shape
    sk, heads_kv, dv = v.shape
    group = heads // heads_kv
    qd = q.double()
    kd = k.double().repeat_interleave(group, dim=1)
    vd = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qd, kd)
    if q_v is not None:
        s = s + torch.einsum("qhd,khd->hqk", q_v.double(), vd)
    s = s * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(sq, device=q.device) + (sk - sq)  # bottom-right aligned i'
    j = torch.arange(sk, device=q.device)
    if alibi is not None:
        dist = (pos[:, None] - j[None, :]).abs().double()
        if alibi_sqrt:
            dist = dist.sqrt()
        s = s - alibi.double()[:, None, None] * dist[None]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j[None, :] <= pos[:, None]
    left, right = window
    if left >= 0:
        visible &= j[None, :] >= pos[:, None] - left
    if right >= 0:
        visible &= j[None, :] <= pos[:, None] + right
    if chunk > 0:
        visible &= torch.div(j[None, :], chunk, rounding_mode="floor") == torch.div(
            pos[:, None], chunk, rounding_mode="floor")
    s = s.masked_fill(~visible[None], -math.inf)
    if sink is not None:  # one extra logit per head with a zero value row
        sink_col = sink.double()[:, None, None].expand(heads, sq, 1)
        s = torch.cat([s, sink_col], dim=2)
        vd = torch.cat([vd, vd.new_zeros(1, heads, dv)], dim=0)
    m = s.amax(dim=2, keepdim=True) if s.shape[2] else s.new_full((heads, sq, 1), -math.inf)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=2)
    out = torch.einsum("hqk,khd->qhd", p, vd) / denom.T[:, :, None].clamp_min(1e-300)
    lse = torch.log(denom) + m_safe[:, :, 0]
    empty = denom == 0
    lse = lse.masked_fill(empty, -math.inf)
    out = out.masked_fill(empty.T[:, :, None], 0.0)
    return out.float(), lse.float()


def gather_paged(cache: torch.Tensor, blocks: torch.Tensor, length: int,
                 descale: torch.Tensor | None = None) -> torch.Tensor:
    """Rows 0..length of one sequence from a paged cache [num_blocks, block_size, H_kv, D]
    (any strides) as float32 [length, H_kv, D], times descale [H_kv] when given."""
    block_size = cache.shape[1]
    t = torch.arange(length, device=cache.device)
    ids = blocks.long()[t // block_size]
    rows = cache[ids, t % block_size].float()
    if descale is not None:
        rows = rows * descale.float()[None, :, None]
    return rows


def per_seq(lens: list[int]) -> list[tuple[int, int]]:
    """(begin, end) of each sequence from its length."""
    out, begin = [], 0
    for n in lens:
        out.append((begin, begin + n))
        begin += n
    return out


def varlen_ref(q: torch.Tensor, q_lens: list[int], keys: list[torch.Tensor],
               values: list[torch.Tensor], *, q_descale: torch.Tensor | None = None,
               alibi: torch.Tensor | None = None, q_v: torch.Tensor | None = None,
               **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention: q [total_q, H, D]; keys/values per sequence (float, decoded).

    q_descale: [B, H_kv] for fp8 q; alibi: [H] or [B, H]. Returns out [total_q, H, Dv] and
    lse [H, total_q] (head-major, as flash_attn_varlen_func returns it)."""
    heads, dv = q.shape[1], values[0].shape[2] if values else q.shape[2]
    out = torch.zeros(q.shape[0], heads, dv, dtype=torch.float32, device=q.device)
    lse = torch.zeros(heads, q.shape[0], dtype=torch.float32, device=q.device)
    for b, (lo, hi) in enumerate(per_seq(q_lens)):
        qb = decode_q(q[lo:hi], q_descale[b] if q_descale is not None else None)
        slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
        qv = q_v[lo:hi] if q_v is not None else None
        out[lo:hi], lse[:, lo:hi] = attention_ref(qb, keys[b], values[b], alibi=slopes, q_v=qv, **kw)
    return out, lse


def batched_ref(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], *,
                q_descale: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                q_v: torch.Tensor | None = None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched attention: q [B, sq, H, D] (q_v [B, sq, H, Dv]). Returns out [B, sq, H, Dv],
    lse [B, H, sq]."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        qb = decode_q(q[b], q_descale[b] if q_descale is not None else None)
        slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
        o, l = attention_ref(qb, keys[b], values[b], alibi=slopes,
                             q_v=q_v[b] if q_v is not None else None, **kw)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def decode_q(q: torch.Tensor, descale: torch.Tensor | None) -> torch.Tensor:
    """q as float32; an fp8 q times its per-KV-head descale [H_kv]."""
    x = q.float()
    if descale is not None:
        group = q.shape[1] // descale.shape[0]
        x = x * descale.float().repeat_interleave(group)[None, :, None]
    return x


def merge_ref(a_out: torch.Tensor, a_lse: torch.Tensor, b_out: torch.Tensor,
              b_lse: torch.Tensor, merge_rows: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC.md §4 with token-major lse [T, H]: returns out [T, H, D] float32, lse [T, H].

    +inf counts as -inf; rows t >= merge_rows copy the b state raw."""
    la = a_lse.double().masked_fill(a_lse == math.inf, -math.inf)
    lb = b_lse.double().masked_fill(b_lse == math.inf, -math.inf)
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    total = wa + wb
    empty = total == 0
    wa, wb = (wa / total).masked_fill(empty, 0.0), (wb / total).masked_fill(empty, 0.0)
    out = wa[..., None] * a_out.double() + wb[..., None] * b_out.double()
    lse = (m_safe + torch.log(total)).masked_fill(empty, -math.inf)
    if merge_rows is not None:
        out[merge_rows:] = b_out[merge_rows:].double()
        lse[merge_rows:] = b_lse[merge_rows:].double()
    return out.float(), lse.float()


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """x / scale in fp32, saturated, rounded to nearest even into fp8 (as caches store it).
    scale broadcasts against x's trailing dims ([] or [H, 1])."""
    y = x.float() / scale.float()
    return y.clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          kv_cache_dtype: str, k_scale: torch.Tensor,
                          v_scale: torch.Tensor) -> None:
    """Writes the caches [num_blocks, block_size, H_kv, D] in place, bit for bit as SPEC.md §3
    says (any strides; uint8 or float8 storage for fp8); slots < 0 are skipped."""
    kc, vc = key_cache, value_cache
    slots = slot_mapping.long()
    rows = torch.nonzero(slots >= 0).flatten()
    blk, off = slots[rows] // kc.shape[1], slots[rows] % kc.shape[1]
    fp8 = FP8_DTYPES.get(kv_cache_dtype)
    for src, dst, scale in ((key, kc, k_scale), (value, vc, v_scale)):
        x = src[rows]
        if fp8 is not None:
            s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
            x = quantize_fp8(x, s, fp8)
            x = x.view(torch.uint8) if dst.dtype == torch.uint8 else x
        dst[blk, off] = x
