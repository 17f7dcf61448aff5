"""The KV store benchmark runs end to end (tiny sizes) against the session's redis-server."""

from __future__ import annotations

from bench import kvstore


def test_kvstore_benchmark_smoke(redis_server, tmp_path, capsys):
    args = ["--redis-url", redis_server.url, "--batch", "2", "--batches", "5",
            "--local-dir", str(tmp_path)]  # fmt: skip
    assert kvstore.main(args) == 0
    out = capsys.readouterr().out
    for row in (
        "| RedisStore put_many |",
        "| RedisStore get_many |",
        "| local:// get_many |",
        "| bfloat16 | 368,728 |",
        "| fp8_e4m3 | 184,648 |",
    ):
        assert row in out
