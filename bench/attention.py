"""Attention over the paged KV cache: the C kernels against the torch path, in one run.

    python -m bench.attention [--dtype float32] [--batches 8,32,64] [--contexts 128,512,1024]
                              [--chunks 0+256,256+256,0+512]

For each batch size B and context length C: B sequences, each decoding its C-th token over
blocks scattered through a pool as large as a model's (`--layers` layers of it, visited in
turn, so the KV comes from memory, not from cache, as in a real forward pass). Shapes are the
embedded model's (9 query heads sharing 3 KV heads of 64 dimensions). Reported per layer: the
kernel's and the torch path's (gather + scaled_dot_product_attention) time, the rate at which
the kernel reads KV, the ratio, and the largest difference between the two outputs.

Then prefill: for each chunk START+N, one sequence with START tokens cached computes N more
(causal over all START + N), K/V written first, as in a forward pass; per layer, both paths'
time (the torch path gathers the cached blocks and runs scaled_dot_product_attention), the
kernel's rate in useful multiply-adds (causal half only), the ratio and the largest difference.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from services.model import kernels
from services.model.batch import ForwardBatch, SeqChunk
from services.model.kv_cache import _allocate
from services.model.layers.attention import CpuAttention, DecodePlan, TorchAttention, _decode_plan
from services.model.loader import DTYPES

BLOCK, HEADS, KV_HEADS, DIM = 16, 9, 3, 64


def setup(
    batch: int, context: int, layers: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodePlan]:
    """Query [B, heads, D], K and V pools [layers, blocks, ...], the batch's plan."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    blocks = batch * per_seq
    k = _allocate((layers, blocks, KV_HEADS, DIM, BLOCK), dtype, "cpu")
    v = _allocate((layers, blocks, KV_HEADS, BLOCK, DIM), dtype, "cpu")
    k.copy_(torch.randn(k.shape, generator=gen))
    v.copy_(torch.randn(v.shape, generator=gen))
    order = torch.randperm(blocks, generator=gen).tolist()  # scattered, as after churn
    chunks = [
        SeqChunk([0], context - 1, order[i * per_seq : (i + 1) * per_seq]) for i in range(batch)
    ]
    plan = _decode_plan(list(ForwardBatch.build(chunks, BLOCK).seqs), BLOCK, torch.device("cpu"))
    q = torch.randn(batch, HEADS, DIM, generator=gen).to(dtype)
    return q, k, v, plan


def per_layer(
    attend: TorchAttention | CpuAttention, q, k, v, plan: DecodePlan, rounds: int
) -> float:
    """Median seconds per layer over `rounds` passes through every layer."""
    layers = k.shape[0]
    times = []
    for _ in range(rounds + 1):  # the first pass warms up
        start = time.perf_counter()
        for i in range(layers):
            attend._decode(q, k[i], v[i], plan)
        times.append((time.perf_counter() - start) / layers)
    return sorted(times[1:])[len(times[1:]) // 2]


def prefill_setup(
    start: int, n: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
    """q [n, heads, D], new k, v [n, kv_heads, D], K and V pools, and the chunk's batch."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-(start + n) // BLOCK)
    pool = 4 * blocks  # scattered through a pool larger than the sequence
    k = torch.randn(pool, KV_HEADS, DIM, BLOCK, generator=gen).to(dtype)
    v = torch.randn(pool, KV_HEADS, BLOCK, DIM, generator=gen).to(dtype)
    table = torch.randperm(pool, generator=gen)[:blocks].tolist()
    chunk = ForwardBatch.build([SeqChunk([0] * n, start, table)], BLOCK)
    q = torch.randn(n, HEADS, DIM, generator=gen).to(dtype)
    k_new = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
    v_new = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
    return q, k_new, v_new, k, v, chunk


def prefill_table(kernel: CpuAttention, chunks: str, dtype: torch.dtype, rounds: int) -> None:
    print("\n| cached | new tokens | kernel us | torch us | kernel GFLOP/s | ratio | max diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    reference = TorchAttention()
    for spec in chunks.split(","):
        start, n = map(int, spec.split("+"))
        q, k_new, v_new, k, v, chunk = prefill_setup(start, n, dtype)
        seconds, outs = [], []
        for attend in (kernel, reference):
            plan = attend.plan(chunk)
            times = []
            for _ in range(rounds + 1):  # the first warms up
                begin = time.perf_counter()
                out = attend.forward(q, k_new, v_new, k, v, plan)
                times.append(time.perf_counter() - begin)
            seconds.append(sorted(times[1:])[len(times[1:]) // 2])
            outs.append(out.float())
        # q.k and p.v over keys 0..position for every query: 2 products of D, 2 FLOP each
        flop = 4 * HEADS * DIM * sum(start + i + 1 for i in range(n))
        print(
            f"| {start} | {n} | {seconds[0] * 1e6:.0f} | {seconds[1] * 1e6:.0f} | "
            f"{flop / seconds[0] / 1e9:.0f} | {seconds[1] / seconds[0]:.2f}x | "
            f"{(outs[0] - outs[1]).abs().max().item():.1e} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--contexts", default="128,512,1024")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunks", default="0+256,256+256,0+512", help="prefill: CACHED+NEW,...")
    args = p.parse_args(argv)

    library = kernels.load("paged_attention")
    if library is None:
        print("the C kernel could not be built here (no C compiler?)", file=sys.stderr)
        return 1
    dtype = DTYPES[args.dtype]
    kernel, reference = CpuAttention(library), TorchAttention()
    print(f"decode attention, {args.dtype}, {torch.get_num_threads()} threads, per layer")
    print("| batch | context | kernel us | torch us | kernel reads KV at | ratio | max diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            q, k, v, plan = setup(batch, context, args.layers, dtype)
            ours = per_layer(kernel, q, k, v, plan, args.rounds)
            torch_path = per_layer(reference, q, k, v, plan, args.rounds)
            kv_bytes = batch * context * KV_HEADS * DIM * 2 * k.element_size()
            diff = kernel._decode(q, k[0], v[0], plan) - reference._decode(q, k[0], v[0], plan)
            print(
                f"| {batch} | {context} | {ours * 1e6:.0f} | {torch_path * 1e6:.0f} | "
                f"{kv_bytes / ours / 1e9:.1f} GB/s | {torch_path / ours:.2f}x | "
                f"{diff.abs().max().item():.1e} |"
            )
            del q, k, v
    prefill_table(kernel, args.chunks, dtype, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
