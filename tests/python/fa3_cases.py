"""Shared scaffolding of the flashserve.fa3 tests (test_fa3.py, test_fa3_kvcache.py): the
`case` fixture's random features (causal, window, softcap, sinks, attention_chunk, softmax_scale)
with their reference keywords, and the drawn head counts and head size."""

from __future__ import annotations

import torch

from helpers_torch import Case

E4M3 = torch.float8_e4m3fn


def draw_features(case: Case, heads: int, device: str, chunk_ok: bool = True) -> tuple[dict, dict]:
    """(fa3 kwargs, reference kwargs): causal, window, softcap, sinks (fp32 or bf16),
    attention_chunk, softmax_scale, each drawn at random."""
    api, ref = {}, {}
    scale = case.rng.choice([None, case.rng.uniform(0.05, 0.2)])
    api["softmax_scale"], ref["scale"] = scale, scale
    api["causal"] = ref["causal"] = case.rng.random() < 0.5
    if case.rng.random() < 0.3:
        window = (case.rng.randint(0, 20), case.rng.choice([-1, 0, 3]))
        api["window_size"] = case.rng.choice([window, list(window), torch.tensor(window)])
        ref["window"] = window
    if case.rng.random() < 0.3:
        api["softcap"] = ref["softcap"] = case.rng.uniform(2.0, 20.0)
    if case.rng.random() < 0.3:
        sink = torch.randn(heads, generator=case.gen) * 2.0
        sink = sink.to(case.rng.choice([torch.float32, torch.bfloat16])).to(device)
        api["sinks"], ref["sink"] = sink, sink.float()
    if chunk_ok and case.rng.random() < 0.3:
        api["attention_chunk"] = ref["chunk"] = case.rng.choice([4, 8, 16])
    return api, ref


def scaled(ref: dict, d: int) -> dict:
    kw = dict(ref)
    if kw.get("scale") is None:
        kw["scale"] = d ** -0.5
    return kw


def heads_dims(case: Case) -> tuple[int, int, int]:
    heads_kv = case.rng.choice([1, 2])
    return heads_kv * case.rng.choice([1, 2, 4]), heads_kv, case.rng.choice([64, 128])
