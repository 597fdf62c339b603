"""Host overhead per call of a decode-shaped flash_attn_varlen_func (paged KV cache, one query
token per sequence), against torch's scaled_dot_product_attention on the same shapes.

    python bench/py_overhead.py                 # CPU tensors
    python bench/py_overhead.py --device cuda   # CUDA tensors (the number that matters)

Rows (microseconds per call, best of --repeats runs of --iters calls):
  drop-in host      flash_attn_varlen_func with the C++ call in validate-only mode: the Python
                    drop-in, argument conversion, every check and the plan, nothing computed
  torch.ops host    the same through the dispatcher (torch.ops.flashserve.varlen_fwd), the path
                    torch.compile graphs take
  binding host      the extension call alone (validate-only), no Python drop-in
  drop-in           the real call (CPU: includes the reference's compute; CUDA: asynchronous
                    launches, so max(host time, kernel time) per call)
  torch.ops         the real call through the dispatcher
  sdpa              torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    on contiguous [B, H, 1, D] / [B, H_kv, L, D] (CPU: includes its compute)

CPU defaults are tiny (H=8, H_kv=2, D=64, L=32, fp32) so that compute does not hide overhead;
CUDA defaults are a real decode (H=32, H_kv=8, D=128, L=512, bf16).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

import flashserve
from flashserve import _C, _calls


def best_us(fn: Callable[[], object], iters: int, repeats: int, cuda: bool) -> float:
    """Best over `repeats` of the mean wall time of `iters` calls, in microseconds."""
    for _ in range(min(iters, 50)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def decode_case(batch: int, heads: int, kv_heads: int, head_dim: int, seq_len: int, block_size: int,
                dtype: torch.dtype, device: str) -> dict:
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return {
        "q": torch.randn(batch, heads, head_dim, dtype=dtype, device=device),
        "k_cache": torch.randn(shape, dtype=dtype, device=device),
        "v_cache": torch.randn(shape, dtype=dtype, device=device),
        "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seqused_k": torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        "block_table": torch.randperm(num_blocks, device=device).to(torch.int32).reshape(batch, blocks_per_seq),
        "sdpa_q": torch.randn(batch, heads, 1, head_dim, dtype=dtype, device=device),
        "sdpa_kv": torch.randn(batch, kv_heads, seq_len, head_dim, dtype=dtype, device=device),
    }


def measure(c: dict, seq_len: int, iters: int, repeats: int, cuda: bool) -> dict:
    q, kc, vc, cu, lens, table = (c[n] for n in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seqused_k",
                                                 "block_table"))
    out = torch.empty_like(q)

    def drop_in() -> object:
        return flashserve.flash_attn_varlen_func(q, kc, vc, 1, cu, seq_len, seqused_k=lens, block_table=table,
                                                 causal=True, out=out)

    stream = torch.cuda.current_stream().cuda_stream if cuda else None

    def binding() -> object:
        return _C.attention(1, False, q, None, out, None, kc, vc, False, cu, None, lens, table, None, 1, seq_len,
                            0.0, 0.0, None, False, True, -1, -1, 0, None, None, None, None, None, None, None,
                            1, 0, None, 0, False, None, None, stream)

    def via_op() -> object:
        return torch.ops.flashserve.varlen_fwd(q, kc, vc, out, cu, 1, seq_len, None, None, lens, table, None,
                                               0.0, True)

    def sdpa() -> object:
        return torch.nn.functional.scaled_dot_product_attention(c["sdpa_q"], c["sdpa_kv"], c["sdpa_kv"],
                                                                enable_gqa=True)

    rows = {}
    _calls._RUN = 1  # validate-only: every check and the plan, nothing computed
    try:
        rows["drop-in host"] = best_us(drop_in, iters, repeats, cuda)
        rows["torch.ops host"] = best_us(via_op, iters, repeats, cuda)
    finally:
        _calls._RUN = 0
    rows["binding host"] = best_us(binding, iters, repeats, cuda)
    rows["drop-in"] = best_us(drop_in, iters, repeats, cuda)
    rows["torch.ops"] = best_us(via_op, iters, repeats, cuda)
    rows["sdpa"] = best_us(sdpa, iters, repeats, cuda)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 512 on CUDA, 32 on the CPU")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    # CUDA: a real decode shape. CPU: tiny shapes, so that compute does not hide the overhead.
    heads, kv_heads, head_dim, block_size = (32, 8, 128, 16) if cuda else (8, 2, 64, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    args.seq_len = args.seq_len or (512 if cuda else 32)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")  # else tensors cross through __dlpack__()
    print(f"flashserve {flashserve.__version__} (CUDA kernels: {flashserve.WITH_CUDA}), "
          f"torch {torch.__version__} (DLPack C exchange API: {fast}), device {device}")
    print(f"decode H={heads} H_kv={kv_heads} D={head_dim} L={args.seq_len} block={block_size} "
          f"{str(dtype).split('.')[-1]}; us per call, best of {args.repeats} x {args.iters}")
    names = ["drop-in host", "torch.ops host", "binding host", "drop-in", "torch.ops", "sdpa"]
    print(f"{'B':>3}  " + "  ".join(f"{n:>13}" for n in names))
    for batch in (int(b) for b in args.batches.split(",")):
        case = decode_case(batch, heads, kv_heads, head_dim, args.seq_len, block_size, dtype, args.device)
        rows = measure(case, args.seq_len, args.iters, args.repeats, cuda)
        print(f"{batch:>3}  " + "  ".join(f"{rows[n]:>13.2f}" for n in names))


if __name__ == "__main__":
    main()
