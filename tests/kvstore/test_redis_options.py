"""What a Redis URL can say: TLS, a unix socket, a password or ACL user, and a TTL."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from kvstore.store import StoreUnavailable, open_store
from tests.support.redis_servers import RedisServer, free_port

NS = "1" * 32
ITEM = (b"\x07" * 32, b"value bytes")


async def round_trip(url: str) -> list[bytes | None]:
    store = open_store(url, NS)
    try:
        await store.put_many([ITEM])
        return await store.get_many([ITEM[0]])
    finally:
        await store.close()


def test_tls(tmp_path):
    ca, cert, key = tmp_path / "ca.crt", tmp_path / "server.crt", tmp_path / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    ca.write_bytes(cert.read_bytes())  # self-signed: the certificate is its own CA
    tls_port = free_port()
    server = RedisServer(
        tmp_path / "tls",
        port=0,
        extra=("--tls-port", str(tls_port), "--tls-cert-file", str(cert),
               "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
               "--tls-auth-clients", "no"),
        listen_port=tls_port,
    ).start()  # fmt: skip
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
        assert asyncio.run(round_trip(url)) == [ITEM[1]]
    finally:
        server.stop()


def test_unix_socket(tmp_path):
    path = tmp_path / "redis.sock"
    server = RedisServer(tmp_path / "unix", port=0, unix_socket=path).start()
    try:
        assert asyncio.run(round_trip(f"unix://{path}?db=0")) == [ITEM[1]]
    finally:
        server.stop()


def test_password_and_acl_user_from_the_url(tmp_path):
    server = RedisServer(
        tmp_path / "auth",
        extra=("--requirepass", "s3cret",
               "--user", "worker", "on", ">w0rker", "~pdserve:*", "+@all"),
    ).start()  # fmt: skip
    try:
        assert asyncio.run(round_trip(f"redis://:s3cret@127.0.0.1:{server.port}/0")) == [ITEM[1]]
        url = f"redis://worker:w0rker@127.0.0.1:{server.port}/0"
        assert asyncio.run(round_trip(url)) == [ITEM[1]]
        with pytest.raises(StoreUnavailable, match="Authentication"):
            asyncio.run(round_trip(f"redis://worker:wrong@127.0.0.1:{server.port}/0"))
    finally:
        server.stop()


def test_ttl(redis_server):
    async def put():
        store = open_store(redis_server.url, NS, ttl=120)
        await store.put_many([ITEM])
        await store.close()

    asyncio.run(put())
    key = f"pdserve:kv:{NS}:{ITEM[0][:16].hex()}"
    assert 0 < int(redis_server.redis_cli("ttl", key)) <= 120
