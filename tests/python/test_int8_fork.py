

@pytest.mark.parametrize("device", DEVICES)
def test_fork_reshape_and_cache_flash_hnd_and_encoder_call(rng, device):
    """quant_type 0's ops.reshape_and_cache_flash into the fork's HND caches, then the fork's
    flash_attn_varlen_func over contiguous q/k/v (its encoder call) and the paged cache."""
    g = gen(rng)
    H_kv, H, D, bs, nb = 2, 4, 32, 16, 5
    dtype = torch.float16
    kv = torch.full((2, nb, H_kv, bs, D), NAN, dtype=dtype, device=device)
    key_cache, value_cache = kv.unbind(0)
    T = int(rng.integers(1, 2 * bs))
    slots = torch.randperm(nb * bs, generator=g)[:T].to(device)
    key, value = randn(g, T, H_kv, D, dtype=dtype, device=device), randn(g, T, H_kv, D, dtype=dtype, device=device)
    ixf.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", torch.tensor(1.0),
                                torch.tensor(1.0))
    b, o = slots // bs, slots % bs
    assert torch.equal(key_cache[b, :, o], key) and torch.equal(value_cache[b, :, o], value)
    assert kv.isnan().sum() == 2 * (nb * bs - T) * H_kv * D
    q = randn(g, T, H, D, dtype=dtype, device=device)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    out = ixf.flash_attn_varlen_func(q=q, k=key, v=value, out=None, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=T, max_seqlen_k=T, softmax_scale=0.2, causal=False)
    want, _ = attention_ref(q, key, value, scale=0.2)
    torch.testing.assert_close(out.double(), want.double(), atol=4e-3, rtol=4e-3)
    table = torch.arange(nb, dtype=torch.int32, device=device)[None]
    order = torch.argsort(slots)  # the cache read in slot order as one sequence over all blocks
    full = torch.zeros(nb * bs, H_kv, D, dtype=dtype, device=device)
    full[slots] = key
    fullv = torch.zeros(nb * bs, H_kv, D, dtype=dtype, device=device)
    fullv[slots] = value
    kv.nan_to_num_(0.0)
    cu_k = torch.tensor([0, nb * bs], dtype=torch.int32, device=device)
    out2, lse = ixf.flash_attn_varlen_func(q=q, k=key_cache, v=value_cache, cu_seqlens_q=cu, cu_seqlens_k=cu_k,
                                           max_seqlen_q=T, max_seqlen_k=1, softmax_scale=0.2, causal=False,
                                           block_table=table, return_softmax_lse=True)
    want2, want_lse = attention_ref(q, full, fullv, scale=0.2)
    torch.testing.assert_close(out2.double(), want2.double(), atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)
    del order
