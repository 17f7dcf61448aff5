"""local://: one process writing, another reading the same keys, never a partial value."""

from __future__ import annotations

import multiprocessing

from tests.support import local_store_workers as workers


def test_reader_never_sees_a_partial_value(tmp_path):
    url = f"local://{tmp_path}"
    ctx = multiprocessing.get_context("spawn")
    rounds = ctx.Value("i", 0)
    result = ctx.Array("i", 2)
    procs = [
        ctx.Process(target=workers.writer, args=(url, 3.0, rounds)),
        ctx.Process(target=workers.reader, args=(url, 3.0, result)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    reads, bad = result[0], result[1]
    assert rounds.value >= 5, "the writer should have rewritten every key several times"
    assert reads >= 50
    assert bad == 0, f"{bad} of {reads} reads were partial or corrupt"
