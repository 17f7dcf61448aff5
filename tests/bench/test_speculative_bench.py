"""The speculative-decoding benchmark runs end to end (tiny sizes): every workload with each
proposer (a 2-layer draft cut from the model included), the same tokens as without
speculation (the benchmark asserts it), and the plot."""

from __future__ import annotations

from bench import speculative


def test_speculative_benchmark_smoke(capsys, tmp_path):
    plot = tmp_path / "spec.png"
    args = ["--prompts", "2", "--tokens", "8", "--concurrent", "2", "--plot", str(plot),
            "--draft-layers", "2"]  # fmt: skip
    assert speculative.main(args) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()]
    configs = ("off", "ngram", "suffix", "draft (2 layers)")
    runs = [r for r in rows if r and r[1] in configs]
    assert [(r[0], r[1]) for r in runs] == [
        (w, s)
        for w in (
            "grounded, 1 stream",
            "open questions, 1 stream",
            "random tokens, 1 stream",
            "grounded, 2 concurrent",
        )
        for s in configs
    ]
    assert len({r[2] for r in runs[:4]}) == 1  # the same number of tokens each way
    assert all(r[4] == "1.00x" for r in runs[::4])
    assert int(runs[3][5]) > 0  # the draft proposed
    assert plot.stat().st_size > 0
