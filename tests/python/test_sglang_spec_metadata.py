"""flashserve.sglang.spec_metadata: the top-k > 1 metadata of SGLang's FlashAttention backend
(draft decode's expand pass, target verify's expand pass from the tree's custom_mask, the
sliding-window verify page table) from flashserve's operations, compared with SGLang's torch
formulation (written out below from flashattention_backend.py: sort keys over the mask,
repeat_interleave, the Triton kernel's masked loads) on random trees; eagerly, under
torch.inference_mode, torch.compile(fullgraph=True) and (CUDA) graph capture and replay; bad
arguments raise naming themselves with nothing written."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flashserve")

from flashserve.sglang import spec_metadata as sm  # noqa: E402

from helpers_torch import DEVICES, HAS_CUDA, Case, capture  # noqa: E402

I32 = torch.int32


@pytest.fixture
def case(request) -> Case:
    return Case(request)


# ----------------------------------------------------------------------------- SGLang's formulation

def sgl_draft_expand(out_cache_loc, num_steps, decode_length):
    cache_loc = out_cache_loc.view(-1, num_steps)
    n = cache_loc.shape[0]
    device = out_cache_loc.device
    return (cache_loc[:, :decode_length].contiguous().to(I32),
            torch.full((n,), decode_length, dtype=I32, device=device),
            torch.arange(0, n * decode_length + 1, decode_length, dtype=I32, device=device))


def sgl_verify_expand(custom_mask, req_to_token, req_pool_indices, seq_lens, n, positions_numel=None):
    device = seq_lens.device
    offsets = torch.arange(n, device=device).unsqueeze(0)
    cols = offsets.expand(seq_lens.numel(), -1) + seq_lens.unsqueeze(1)
    cum_len = torch.nn.functional.pad(torch.cumsum((seq_lens + n).repeat_interleave(n), dim=0), (1, 0))[:-1]
    idx = (cols.repeat_interleave(n, dim=0) + cum_len[:, None]).view(1, -1)
    if positions_numel is not None:
        idx[:, positions_numel * n:].fill_(0)
    mask = custom_mask[idx].view(-1, n)
    col_indices = offsets.expand(mask.shape[0], n)
    keys = torch.where(mask, col_indices, col_indices + n)
    _, sort_order = torch.sort(keys, dim=1)
    table = req_to_token[req_pool_indices, :].gather(1, cols).repeat_interleave(n, dim=0)
    lens = mask.sum(dim=1).to(I32)
    return table.gather(1, sort_order).to(I32), lens, torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=I32), (1, 0))


def sgl_window(page_table_a, page_table_b, seq_len_a, seq_len_b, n, width):
    """prepare_swa_spec_page_table_triton into new_zeros, and the lengths of
    _init_sliding_window_attn_spec_metadata."""
    rows = seq_len_b.numel()
    dst = torch.zeros(rows, width, dtype=I32)
    a, b, la_all, lb_all = (t.cpu() for t in (page_table_a, page_table_b, seq_len_a, seq_len_b))
    for r in range(rows):
        la, lb = int(la_all[r // n]), int(lb_all[r])
        for c in range(la + lb):
            if c < la:
                dst[r, c] = a[r // n, c] if c < a.shape[1] else 0
            else:
                dst[r, c] = b[r, c - la] if c - la < b.shape[1] else 0
    lens = (seq_len_a.repeat_interleave(n) + seq_len_b).to(I32)
    return dst.to(seq_len_a.device), lens, torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=I32), (1, 0))


# ----------------------------------------------------------------------------- random batches

def tree_batch(case: Case, device: str, bs: int, n: int, pool: int = 12, max_len: int = 30, lens=None):
    """req_to_token, req_pool_indices (int64), seq_lens (int64, random unless given) and SGLang's
    flattened custom_mask (bool, per request [n, seq_len + n]: the prefix and each draft's
    ancestors and itself)."""
    cols = max_len + n + 2
    req_to_token = case.randint(0, 1 << 20, (pool, cols)).to(I32).to(device)
    rows = torch.tensor(case.perm(pool)[:bs], dtype=torch.int64, device=device)
    lens = [case.rng.randint(0, max_len) for _ in range(bs)] if lens is None else lens
    masks = []
    for length in lens:
        parent = [case.rng.randint(-1, j - 1) for j in range(n)]
        for i in range(n):
            shown, j = set(), i
            while j >= 0:
                shown.add(j)
                j = parent[j]
            masks.append([True] * length + [j in shown for j in range(n)])
    mask = torch.tensor([x for row in masks for x in row], dtype=torch.bool, device=device)
    return req_to_token, rows, torch.tensor(lens, dtype=torch.int64, device=device), mask


def run_all(loc, num_steps, decode_length, mask, req_to_token, rows, seq_lens, n, mask_rows, table_a, len_a):
    """The three operations into fresh buffers, as the backend's eager metadata builds them."""
    device = seq_lens.device
    draft = sm.new_expand_buffers(loc.numel() // num_steps, decode_length, device)
    sm.draft_decode_expand(loc, num_steps, decode_length, *draft)
    verify = sm.new_expand_buffers(seq_lens.numel() * n, n, device)
    sm.verify_expand(mask, req_to_token, rows, seq_lens, n, mask_rows, *verify)
    window = (torch.zeros(verify[0].shape[0], table_a.shape[1] + n, dtype=I32, device=device),
              *sm.new_lengths(verify[0].shape[0], device))
    sm.window_page_table(table_a, verify[0], len_a, verify[1], n, *window)
    return (*draft, *verify, *window)


def step_inputs(case: Case, device: str, bs: int = 3, n: int = 4, topk: int = 3, steps: int = 4, lens=None):
    req_to_token, rows, seq_lens, mask = tree_batch(case, device, bs, n, lens=lens)
    loc = case.randint(0, 1 << 30, (bs, topk, steps)).to(device)
    table_a = req_to_token[rows, :int(seq_lens.max()) + 1]
    return dict(loc=loc, num_steps=steps, decode_length=case.rng.randint(1, steps), mask=mask,
                req_to_token=req_to_token, rows=rows, seq_lens=seq_lens, n=n, mask_rows=None, table_a=table_a,
                len_a=seq_lens.to(I32))


def check_equal(what: str, got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.cpu(), w.cpu()), f"{what}: output {i}\n{g}\n!=\n{w}"


# ----------------------------------------------------------------------------- against SGLang

@pytest.mark.parametrize("device", DEVICES)
def test_draft_decode_expand_matches_sglang(case: Case, device: str) -> None:
    for i in range(6):
        bs, topk, steps = case.rng.randint(1, 5), case.rng.randint(2, 4), case.rng.randint(1, 5)
        loc = case.randint(0, 1 << 40, (bs, topk, steps)).to(device)
        if i % 2:
            loc = loc.to(I32 if i % 4 == 1 else torch.int64)
        length = case.rng.randint(1, steps)
        got = sm.new_expand_buffers(bs * topk, length, device)
        sm.draft_decode_expand(loc, steps, length, *got)
        check_equal(f"case {i}", got, sgl_draft_expand(loc, steps, length))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True])
def test_verify_expand_matches_sglang(case: Case, device: str, padded: bool) -> None:
    """Eager (every request's mask) and graph replay of a padded batch (SGLang reads mask
    element 0 for the rows past spec_info.positions)."""
    for i in range(6):
        bs, n = case.rng.randint(1, 5), case.rng.randint(1, 6)
        req_to_token, rows, seq_lens, mask = tree_batch(case, device, bs, n)
        real = case.rng.randint(0, bs) * n if padded else None
        if i % 2:
            rows, seq_lens = rows.to(I32), seq_lens.to(I32)
        got = sm.new_expand_buffers(bs * n, n, device)
        sm.verify_expand(mask, req_to_token, rows, seq_lens, n, real, *got)
        check_equal(f"case {i}", got, sgl_verify_expand(mask, req_to_token, rows, seq_lens.long(), n, real))


@pytest.mark.parametrize("device", DEVICES)
def test_window_page_table_matches_sglang(case: Case, device: str) -> None:
    for i in range(6):
        bs, n = case.rng.randint(1, 4), case.rng.randint(1, 4)
        len_a, len_b = case.rng.randint(1, 20), case.rng.randint(1, 5)
        table_a = case.randint(0, 1000, (bs, len_a)).to(I32).to(device)
        table_b = case.randint(0, 1000, (bs * n, len_b)).to(I32).to(device)
        la = case.randint(0, len_a + 1, (bs,)).to(I32).to(device)
        lb = case.randint(0, len_b + 1, (bs * n,)).to(I32).to(device)
        width = len_a + len_b + case.rng.randint(0, 3)
        got = (torch.zeros(bs * n, width, dtype=I32, device=device), *sm.new_lengths(bs * n, device))
        sm.window_page_table(table_a, table_b, la, lb, n, *got)
        check_equal(f"case {i}", got, sgl_window(table_a, table_b, la, lb, n, width))
        dst = torch.zeros(bs * n + 2, width, dtype=I32, device=device)  # SGLang's signature, larger buffer
        sm.prepare_swa_spec_page_table(dst, table_a, table_b, la, lb, n)
        check_equal(f"case {i} prepare_swa_spec_page_table", (dst[:bs * n],), got[:1])


# ----------------------------------------------------------------------------- inference mode, compile, graphs

@pytest.mark.parametrize("device", DEVICES)
def test_inference_mode_and_compile(case: Case, device: str) -> None:
    """The three operations of one step under torch.inference_mode and
    torch.compile(fullgraph=True) equal eager ones bit for bit."""
    args = step_inputs(case, device)
    eager = run_all(**args)
    check_equal("eager vs SGLang (verify)", eager[3:6], sgl_verify_expand(args["mask"], args["req_to_token"],
                                                                          args["rows"], args["seq_lens"], args["n"]))
    with torch.inference_mode():
        inf_args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        check_equal("inference_mode", run_all(**inf_args), eager)
    torch._dynamo.reset()
    compiled = torch.compile(run_all, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    check_equal("compiled", compiled(**args), eager)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graph capture needs CUDA")
def test_cuda_graph_capture_replay(case: Case) -> None:
    """The operations captured into a CUDA graph over static buffers (as init_cuda_graph_state's)
    and replayed after new inputs are copied in equal eager runs on those inputs."""
    args = step_inputs(case, "cuda")
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    outs = run_all(**static)  # the static outputs, written in place by every replay

    def fill() -> None:
        draft, verify, window = outs[:3], outs[3:6], outs[6:]
        sm.draft_decode_expand(static["loc"], static["num_steps"], static["decode_length"], *draft)
        sm.verify_expand(static["mask"], static["req_to_token"], static["rows"], static["seq_lens"], static["n"],
                         None, *verify)
        sm.window_page_table(static["table_a"], verify[0], static["len_a"], verify[1], static["n"], *window)

    graph = capture(fill, warmup=1)
    for i in range(3):
        # new contents of the same shapes: the lengths permuted among the requests (the mask's
        # length and the prefix table's width stay), new trees, slots, pool rows and drafts
        lens = args["seq_lens"].tolist()
        lens = [lens[j] for j in case.perm(len(lens))]
        new = step_inputs(case, "cuda", lens=lens)
        new["decode_length"] = static["decode_length"]
        for k, v in new.items():
            if isinstance(v, torch.Tensor):
                static[k].copy_(v)
        for t in outs:
            t.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        want = run_all(**new)
        # the window page table (output 6) is written up to each row's length (outputs 7), as
        # SGLang's kernel: columns past it keep the poison here and zeros in the fresh eager run
        got = list(outs)
        got[6], want = _up_to_length(outs[6], outs[7]), list(want)
        want[6] = _up_to_length(want[6], want[7])
        check_equal(f"replay {i}", got, want)


def _up_to_length(table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """table with the columns at and past each row's length zeroed (a copy)."""
    cols = torch.arange(table.shape[1], device=table.device)[None, :]
    return torch.where(cols < lengths.to(table.device)[:, None], table, torch.zeros_like(table))


# ----------------------------------------------------------------------------- errors

def test_errors_name_the_argument(case: Case) -> None:
    """Bad arguments raise ValueError naming the argument, with every output unchanged."""
    args = step_inputs(case, "cpu")
    n, bs = args["n"], args["seq_lens"].numel()
    outs = sm.new_expand_buffers(bs * n, n, "cpu")
    for t in outs:
        t.fill_(-7)

    def unchanged() -> None:
        assert all(bool((t == -7).all()) for t in outs), "an output was written"

    bad_rows = args["rows"].clone()
    bad_rows[0] = args["req_to_token"].shape[0]
    with pytest.raises(ValueError, match="^req_pool_indices: expected"):
        sm.verify_expand(args["mask"], args["req_to_token"], bad_rows, args["seq_lens"], n, None, *outs)
    unchanged()
    with pytest.raises(ValueError, match="^custom_mask: expected"):
        sm.verify_expand(args["mask"][:-1], args["req_to_token"], args["rows"], args["seq_lens"], n, None, *outs)
    unchanged()
    with pytest.raises(ValueError, match="^page_table: expected"):
        sm.verify_expand(args["mask"], args["req_to_token"], args["rows"], args["seq_lens"], n, None,
                         outs[0].long(), *outs[1:])
    unchanged()
    with pytest.raises(ValueError, match="^decode_length: expected"):
        sm.draft_decode_expand(args["loc"], args["num_steps"], args["num_steps"] + 1,
                               torch.zeros(args["loc"].numel() // args["num_steps"], 8, dtype=I32),
                               *sm.new_lengths(args["loc"].numel() // args["num_steps"], "cpu"))
    with pytest.raises(ValueError, match="^page_table: expected"):  # a row longer than the table
        sm.window_page_table(args["table_a"], outs[0], args["len_a"] + 100, outs[1].fill_(1), n,
                             torch.zeros(bs * n, 4, dtype=I32), *sm.new_lengths(bs * n, "cpu"))
    with pytest.raises(ValueError, match="^mask_rows: expected"):
        sm.verify_expand(args["mask"], args["req_to_token"], args["rows"], args["seq_lens"], n, bs * n + 1,
                         *sm.new_expand_buffers(bs * n, n, "cpu"))
