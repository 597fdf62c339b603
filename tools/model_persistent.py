#!/usr/bin/env python3
"""A model of the persistent prefill kernels' synchronization (src/kernels/attention/
prefill_persistent.cuh, prefill_tma.cuh: consume_tiles, Producer; prefill_fp8.cuh: produce_fp8),
run over random item walks and random interleavings: it finds deadlocks (every actor blocked) and
data hazards (a buffer overwritten before every reader released it, or read before it holds the
tile the reader expects) without a GPU.

Actors: the producer warps (bf16: warp 0 loads Q, K and V and hands the items over; fp8: warp 0
loads Q, K and raw V, and all four warps transpose V), and the consumer warpgroups (2, or 3 at
D = 64), each one actor arriving with its 4 warps. mbarriers complete a phase when their count of
arrivals is reached; a wait for parity P passes while the current phase's parity differs from P
(the hardware's try_wait.parity, ABA included). Named barriers complete when both warpgroups (one
syncing, one arriving) reached them. TMA writes are taken at issue (a stricter check: the data
lands later). The kernel code, not this model, is what runs: keep them in step when either
changes.

  tools/model_persistent.py [--walks N] [--seed S]
"""
import argparse
import random


class Mbar:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self, n=1):
        self.pending -= n
        assert self.pending >= 0, "more arrivals than the phase's count"
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity):
        return (self.phase & 1) != parity


class Named:
    """bar.sync / bar.arrive over two warpgroups (2 x 128 threads)."""

    def __init__(self):
        self.arrived, self.gen = 0, 0

    def arrive(self):
        self.arrived += 1
        if self.arrived == 2:
            self.arrived, self.gen = 0, self.gen + 1


class Buffer:
    """What a shared-memory buffer holds, and which readers released it."""

    def __init__(self, readers):
        self.tag, self.released, self.readers = None, set(readers), set(readers)

    def write(self, tag, what):
        assert self.released == self.readers, f"{what}: overwritten with {tag} while {self.tag} is still read"
        self.tag, self.released = tag, set()

    def read(self, tag, what):
        assert self.tag == tag, f"{what}: expected {tag}, holds {self.tag}"

    def release(self, reader):
        self.released.add(reader)


def model(items, wgs, k_ahead, fp8, rng, split=False):
    """items: (active, tiles) per item of one CTA's walk; split: pages shorter than the tile (bf16:
    K by producer warps 0, 1 and V by 2, 3, each a part of every tile). None or the failure."""
    warps = 4 * wgs
    parts = 2 if split and not fp8 else 1  # fp8 splits by operand (warp 0 K, warp 1 V), not by part
    readers = list(range(wgs))
    S = {n: Mbar(1) for n in ("q_full",)}
    for st in (0, 1):
        S[f"k_full{st}"], S[f"v_full{st}"] = Mbar(parts), Mbar(parts)
        S[f"k_empty{st}"] = Mbar(warps)
        S[f"item_full{st}"], S[f"item_empty{st}"] = Mbar(1), Mbar(warps)
        if fp8:
            S[f"v_empty{st}"] = Mbar(4)  # raw V transposed: the 4 producer warps (kTransposeArrivals lanes)
            S[f"vt_full{st}"] = Mbar(4)
            S[f"vt_empty{st}"] = Mbar(warps)
        else:
            S[f"v_empty{st}"] = Mbar(warps)
    S["q_empty"] = Mbar(warps)
    named = {b: Named() for b in range(1, wgs + 1)}
    B = {"q": Buffer(readers)}
    for st in (0, 1):
        B[f"k{st}"], B[f"v{st}"], B[f"slot{st}"] = Buffer(readers), Buffer(readers), Buffer(readers)
        B[f"k{st}'"], B[f"v{st}'"] = Buffer(readers), Buffer(readers)  # split: the second part's half
        if fp8:
            B[f"v{st}"] = Buffer(["t0", "t1", "t2", "t3"])  # raw V: read by the transposing warps
            B[f"vt{st}"] = Buffer(readers)

    def wait(bar, parity):
        return lambda: S[bar].passed(parity)

    def load(kind, J, item, j, part=0):  # producer: (part of) stage J % 2 of K or (raw) V, once released
        st = J & 1
        if J >= 2:
            yield wait(f"{kind}_empty{st}", ((J >> 1) & 1) ^ 1)
        B[f"{kind}{st}" + ("" if part == 0 else "'")].write((item, j), f"{kind}{st} part {part}")
        S[f"{kind}_full{st}"].arrive()

    def transpose(w, J, item, j):  # fp8: producer warp w transposes tile J (raw V -> V^T)
        st = J & 1
        yield wait(f"v_full{st}", (J >> 1) & 1)
        if J >= 2:
            yield wait(f"vt_empty{st}", ((J >> 1) & 1) ^ 1)
        B[f"v{st}"].read((item, j), "raw V")
        if w == 0:  # the four warps write V^T together: one write, four arrivals
            B[f"vt{st}"].write((item, j), f"vt{st}")
        yield lambda: True
        S[f"vt_full{st}"].arrive()
        B[f"v{st}"].release(f"t{w}")
        S[f"v_empty{st}"].arrive()

    def producer(w):
        nq, J = 0, 0
        for i, (active, T) in enumerate(items):
            if w == 0:
                slot = i & 1
                if i >= 2:
                    yield wait(f"item_empty{slot}", ((i >> 1) & 1) ^ 1)
                B[f"slot{slot}"].write(i, "item slot")
                S[f"item_full{slot}"].arrive()
            if not active:
                continue
            if w == 0:
                if nq >= 1:
                    yield wait("q_empty", (nq - 1) & 1)
                B["q"].write(i, "q")
                S["q_full"].arrive()
            nq += 1
            if fp8:  # produce_fp8: warp 0 loads K and raw V of tile j (split: warp 1 V), all transpose j - 1
                for j in range(T):
                    if w == 0:
                        yield from load("k", J + j, i, j)
                    if w == (1 if split else 0):
                        yield from load("v", J + j, i, j)
                    if j >= 1:
                        yield from transpose(w, J + j - 1, i, j - 1)
                if T > 0:
                    yield from transpose(w, J + T - 1, i, T - 1)
            elif split:  # Producer::run_operand: K parts on warps 0, 1, V parts on 2, 3
                for j in range(T):
                    yield from load("k" if w < 2 else "v", J + j, i, j, w % 2)
            elif w == 0:  # Producer::run_both
                if T > 0 and k_ahead:
                    yield from load("k", J, i, 0)
                for j in range(T):
                    if not k_ahead:
                        yield from load("k", J + j, i, j)
                    elif j + 1 < T:
                        yield from load("k", J + j + 1, i, j + 1)
                    yield from load("v", J + j, i, j)
            J += T

    def consumer(wg):
        def my_turn():
            b = named[1 + wg]
            gen = b.gen
            b.arrive()
            yield lambda: b.gen > gen

        def hand_over():
            named[1 if wg + 1 == wgs else wg + 2].arrive()

        def halves(buf):  # a K / V stage is two halves where the producer splits it
            return [buf, buf + "'"] if parts == 2 and buf[0] in "kv" and buf[1:].isdigit() else [buf]

        def read(buf, tag, what):
            for h in halves(buf):
                B[h].read(tag, what)

        def release(bar, buf=None):
            for h in halves(buf) if buf else []:
                B[h].release(wg)
            S[bar].arrive(4)

        vname = "vt" if fp8 else "v"
        if wg == wgs - 1:  # chain_open
            named[1].arrive()
        nq, J = 0, 0
        for i, (active, T) in enumerate(items):
            slot = i & 1
            yield wait(f"item_full{slot}", (i >> 1) & 1)
            read(f"slot{slot}", i, "item slot")
            release(f"item_empty{slot}", f"slot{slot}")
            if not active:
                continue
            yield wait("q_full", nq & 1)
            read("q", i, "q")
            if T <= 0:
                release("q_empty", "q")
            else:  # consume_tiles<kChain>
                st = lambda j: (J + j) & 1
                par = lambda j: ((J + j) >> 1) & 1
                yield wait(f"k_full{st(0)}", par(0))
                yield from my_turn()
                read(f"k{st(0)}", (i, 0), "K")
                read("q", i, "q")
                hand_over()
                yield lambda: True  # wgmma_wait
                release(f"k_empty{st(0)}", f"k{st(0)}")
                if T == 1:
                    release("q_empty", "q")
                for j in range(1, T):
                    yield wait(f"k_full{st(j)}", par(j))
                    yield wait(f"{vname}_full{st(j - 1)}", par(j - 1))
                    yield from my_turn()
                    read(f"k{st(j)}", (i, j), "K")
                    read("q", i, "q")
                    read(f"{vname}{st(j - 1)}", (i, j - 1), "V")
                    hand_over()
                    yield lambda: True
                    release(f"k_empty{st(j)}", f"k{st(j)}")
                    if j == T - 1:
                        release("q_empty", "q")
                    yield lambda: True  # softmax, then P V(j - 1) complete
                    release(f"{vname}_empty{st(j - 1)}", f"{vname}{st(j - 1)}")
                yield wait(f"{vname}_full{st(T - 1)}", par(T - 1))
                yield from my_turn()
                read(f"{vname}{st(T - 1)}", (i, T - 1), "V")
                hand_over()
                yield lambda: True
                release(f"{vname}_empty{st(T - 1)}", f"{vname}{st(T - 1)}")
            nq += 1
            J += T
        if wg == 0:  # chain_close
            b = named[1]
            gen = b.gen
            b.arrive()
            yield lambda: b.gen > gen

    actors = [consumer(w) for w in range(wgs)] + [producer(w) for w in range(4 if fp8 or split else 1)]
    waiting = [None] * len(actors)
    live = list(range(len(actors)))
    try:
        while live:
            ready = [a for a in live if waiting[a] is None or waiting[a]()]
            if not ready:
                return "deadlock"
            a = rng.choice(ready)
            try:
                waiting[a] = next(actors[a])
            except StopIteration:
                live.remove(a)
    except AssertionError as e:
        return f"hazard: {e}"
    for b, n in named.items():
        if n.arrived:
            return f"named barrier {b} left with an arrival"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--walks", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    # (consumer warpgroups, K a tile ahead, fp8, split producer)
    shapes = [(2, True, False, False), (2, False, False, False), (3, True, False, False), (2, True, True, False),
              (2, True, False, True), (3, True, False, True), (2, True, True, True)]
    for wgs, k_ahead, fp8, split in shapes:
        for n in range(args.walks):
            items = [(rng.random() > 0.2, rng.choice([0, 1, 1, 2, 3, 4, 5])) for _ in range(rng.randint(1, 9))]
            why = model(items, wgs, k_ahead, fp8, rng, split)
            if why:
                print(f"FAIL wgs={wgs} k_ahead={k_ahead} fp8={fp8} split={split} items={items}: {why}")
                return 1
        print(f"ok: wgs={wgs} k_ahead={k_ahead} fp8={fp8} split={split}, {args.walks} walks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
