"""The structured-output benchmark runs end to end (tiny sizes): a row per grammar engine and
schema, and the three loads with their token counts equal (no answer completes early)."""

from __future__ import annotations

from bench import structured


def test_structured_benchmark_smoke(capsys):
    assert structured.main(["--sequences", "2", "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()]
    engines = [r for r in rows if r and r[0] == "llguidance"]
    assert [r[1] for r in engines] == list(structured.SCHEMAS)
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in engines)
    loads = {r[0]: r for r in rows if r and r[0].startswith(("unconstrained", "JSON schema"))}
    assert set(loads) == {"unconstrained", "JSON schema", "JSON schema, strings 8-24"}
    assert {r[1] for r in loads.values()} == {"12"}  # 2 sequences x 6 tokens each
    assert loads["unconstrained"][4] == "0.00" and float(loads["JSON schema"][4]) > 0
