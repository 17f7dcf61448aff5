"""One forward pass mixing prefill chunks and decode tokens gives each sequence the logits it
gets alone."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from services.model.batch import ForwardBatch, SeqChunk

BLOCK = 16
# prompt length, and the chunks (start, end) it is fed in across three passes;
# a chunk of length 1 after the prompt is a decode step
PLAN = {
    "a": (700, [(0, 300), (300, 700), (700, 701)]),
    "b": (1, [(0, 1), (1, 2), (2, 3)]),
    "c": (512, [(0, 512), (512, 513), (513, 514)]),
    "d": (33, [(0, 16), (16, 33), (33, 34)]),
    "e": (129, [(0, 100), (100, 129), (129, 130)]),
    "f": (7, [(0, 7), (7, 8), (8, 9)]),
    "g": (250, [(0, 1), (1, 250), (250, 251)]),
    "h": (64, [(0, 64), (64, 65), (65, 66)]),
}


def _tables(lengths: dict[str, int]) -> dict[str, list[int]]:
    """Interleaved, non-contiguous block tables, so that paging really is exercised."""
    need = {k: -(-n // BLOCK) for k, n in lengths.items()}
    tables: dict[str, list[int]] = {k: [] for k in lengths}
    free = iter(reversed(range(sum(need.values()))))
    for round_ in range(max(need.values())):
        for k in lengths:
            if round_ < need[k]:
                tables[k].append(next(free))
    return tables


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(0)
    return {
        k: torch.randint(0, 49152, (chunks[-1][1],), generator=gen).tolist()
        for k, (_, chunks) in PLAN.items()
    }


def _alone(model, tokens: list[int], chunks: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The sequence fed through the same chunks, in passes of its own."""
    kv = model.new_kv_cache(-(-len(tokens) // BLOCK), BLOCK)
    table = list(range(kv.num_blocks))
    return [
        model.forward(ForwardBatch.build([SeqChunk(tokens[s:e], s, table)], BLOCK), kv)[0]
        for s, e in chunks
    ]


@pytest.mark.all_cores  # (tests/conftest.py)
def test_mixed_batch_matches_each_sequence_alone(embedded, sequences):
    model = embedded.model
    alone = {k: _alone(model, sequences[k], plan) for k, (_, plan) in PLAN.items()}
    tables = _tables({k: len(v) for k, v in sequences.items()})
    kv = model.new_kv_cache(sum(len(t) for t in tables.values()), BLOCK)
    for step in range(3):
        chunks = [
            SeqChunk(sequences[k][s:e], s, tables[k])
            for k, (_, plan) in PLAN.items()
            for s, e in [plan[step]]
        ]
        batch = ForwardBatch.build(chunks, BLOCK)
        kinds = {c.is_decode for c in batch.seqs}
        assert kinds == ({True, False} if step < 2 else {True}), "passes 0 and 1 are mixed"
        logits = model.forward(batch, kv)
        for row, k in enumerate(PLAN):
            diff = (logits[row] - alone[k][step]).abs().max().item()
            assert diff < 1e-4, f"sequence {k} at pass {step}: max abs diff {diff}"


def test_logits_only_for_requested_rows(embedded):
    kv = embedded.model.new_kv_cache(2, BLOCK)
    chunks = [SeqChunk([1, 2, 3], 0, [0], want_logits=False), SeqChunk([4, 5], 0, [1])]
    batch = ForwardBatch.build(chunks, BLOCK)
    assert batch.logits_rows.tolist() == [4]
    assert embedded.model.forward(batch, kv).shape == (1, 49152)


def test_slot_mapping_follows_block_table():
    batch = ForwardBatch.build([SeqChunk([9] * 3, 15, [7, 2])], BLOCK)
    assert batch.slot_mapping.tolist() == [7 * 16 + 15, 2 * 16 + 0, 2 * 16 + 1]
    assert batch.positions.tolist() == [15, 16, 17]


def test_short_block_table_is_refused():
    with pytest.raises(ValueError, match="need 2"):
        ForwardBatch.build([SeqChunk([1] * 17, 0, [0])], BLOCK)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm: Linux")
def test_a_kv_pool_reads_zeros_and_takes_memory_only_as_blocks_are_written(embedded):
    """4,096 blocks of the embedded model (2.9 GB in float32) cost no memory until written."""

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE

    before = resident()
    kv = embedded.model.new_kv_cache(4096)
    assert 2 * kv.k.numel() * 4 > 2.8e9
    assert resident() - before < 50e6
    for t in (kv.k, kv.v):
        assert t[:, 0].count_nonzero() == t[:, -1].count_nonzero() == 0
    kv.v[:, 100].fill_(1.0)  # one block in every layer: 30 x 12 KiB
    assert 0 < resident() - before < 300e6  # pages of 4 KiB or 2 MiB, not the pool
    assert kv.v[:, 100].count_nonzero() == kv.v[:, 100].numel()
    assert kv.v[:, 99].count_nonzero() == kv.v[:, 101].count_nonzero() == 0


WIRE_FIELDS = ("token_ids", "positions", "slot_mapping", "logits_rows", "block_tables",
               "seq_rows", "query_lens", "context_lens", "block_size", "max_query_len",
               "max_context_len")  # fmt: skip


@pytest.mark.parametrize("groups", [0, 2])
def test_a_batch_crosses_the_wire_whole(groups):
    """to_wire/from_wire (tensor ranks' FORWARD): every field equal, cache groups' own tables
    (-1 where a part was let go) and slots included."""
    chunks = [
        SeqChunk([5, 6, 7], 0, [4], tables=tuple([9 + g] for g in range(groups))),
        SeqChunk(
            [8],
            40,
            [1, 0, 3],
            want_logits=True,
            tables=tuple([-1, 2 + g, 5] for g in range(groups)),
        ),
        SeqChunk(
            list(range(20)),
            3,
            [2, 7],
            all_logits=True,
            tables=tuple([6, 1 + g] for g in range(groups)),
        ),
    ]
    batch = ForwardBatch.build(chunks, BLOCK)
    back = ForwardBatch.from_wire(batch.to_wire())
    for name in WIRE_FIELDS:
        mine, theirs = getattr(back, name), getattr(batch, name)
        assert torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs
    assert len(back.group_slots) == len(batch.group_slots) == groups
    assert all(torch.equal(a, b) for a, b in zip(back.group_slots, batch.group_slots, strict=True))
    for a, b in zip(back.seqs, batch.seqs, strict=True):
        assert (a.row, a.query_len, a.context_len) == (b.row, b.query_len, b.context_len)
        assert a.block_table.tolist() == b.block_table.tolist()
        assert [t.tolist() for t in a.tables] == [t.tolist() for t in b.tables]
