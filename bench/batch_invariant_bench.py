"""Batch-invariant mode (batch_invariant=True) against the default split heuristic: bf16 paged decode,
GQA 32/8, D=128, block 16, through flashserve.flash_attn_with_kvcache; CUDA graphs of 20 calls timed
with events (best of 5). Issue 15 target: invariant speed >= 0.9x default at every (B, L).

    PYTHONPATH=build/cuda-dev/python python3 bench/batch_invariant_bench.py
"""
import torch, flashserve
torch.manual_seed(0)
H, Hkv, D, bs = 32, 8, 128, 16
for B, L in [(64, 4096), (16, 8192), (1, 32768), (256, 1024), (8, 131072)]:
    nblk = L // bs
    kc = torch.randn(B * nblk, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(B * nblk, device="cuda", dtype=torch.int32).view(B, nblk)
    sl = torch.full((B,), L, device="cuda", dtype=torch.int32)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    res = {}
    for inv in (False, True):
        f = lambda: flashserve.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, block_table=bt, causal=True, out=out, batch_invariant=inv)
        f(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            f()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(20): f()
        g.replay(); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = 1e9
        for _ in range(5):
            e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) / 20 * 1e3)
        res[inv] = (best, out.clone())
    gb = 2 * B * L * Hkv * D * 2 / 1e9
    print(f"B={B:4d} L={L:6d}: default {res[False][0]:8.1f} us ({gb/res[False][0]*1e6:6.0f} GB/s)  invariant {res[True][0]:8.1f} us ({gb/res[True][0]*1e6:6.0f} GB/s)  inv/default speed {res[False][0]/res[True][0]:.3f}  maxdiff {(res[False][1].float()-res[True][1].float()).abs().max().item():.2e}", flush=True)
    del kc, vc
