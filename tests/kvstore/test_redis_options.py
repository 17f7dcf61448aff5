"""What a Redis URL can say: TLS, a unix socket, a password or ACL user, and a TTL."""

from __future__ import annotations

import asyncio
import re

import pytest

from kvstore import open_store
from kvstore.store import StoreUnavailable
from tests.support.redis_servers import ACLUser, RedisServer, TLSFiles

NS = "1" * 32
ITEM = (b"\x07" * 32, b"value bytes")


async def round_trip(url: str) -> list[bytes | None]:
    store = open_store(url, NS)
    try:
        await store.put_many([ITEM])
        return await store.get_many([ITEM[0]])
    finally:
        await store.close()


def start_tls_server(workdir, **options) -> RedisServer:
    """A TLS-only redis-server with a fresh CA; the test is skipped (saying why) where
    redis-server was built without TLS."""
    server = RedisServer(workdir, tls=TLSFiles.make(workdir / "certs"), **options)
    try:
        return server.start()
    except RuntimeError as e:
        log = server.log_path.read_text()
        if re.search(r"tls.*(not supported|bad directive)", log, re.IGNORECASE | re.DOTALL):
            pytest.skip(f"this redis-server has no TLS (built without BUILD_TLS=yes): {e}")
        raise


def test_tls_with_client_certificates_and_an_acl_user(tmp_path):
    worker = ACLUser("worker", "w0rker pass")  # a space: quoted in the URL
    server = start_tls_server(tmp_path, password="s3cret", users=[worker])
    try:
        assert asyncio.run(round_trip(server.url)) == [ITEM[1]]
        assert asyncio.run(round_trip(server.url_for("worker", "w0rker pass"))) == [ITEM[1]]
        assert server.redis_cli("ping").strip() == "PONG"
        tls = server.tls
        assert tls is not None
        no_client_cert = server.url.split("&ssl_certfile")[0]
        with pytest.raises(StoreUnavailable):  # the server asks for a client certificate
            asyncio.run(round_trip(no_client_cert))
        with pytest.raises(StoreUnavailable):  # the server's certificate is not trusted
            asyncio.run(
                round_trip(server.url.replace(str(tls.ca), "/etc/ssl/certs/ca-certificates.crt"))
            )
        plain = f"redis://:s3cret@127.0.0.1:{server.listen_port}/0"
        with pytest.raises(StoreUnavailable):  # TLS only
            asyncio.run(round_trip(plain))
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
    worker = ACLUser("worker", "w0rker")
    server = RedisServer(tmp_path / "auth", password="s3cret", users=[worker]).start()
    try:
        assert asyncio.run(round_trip(server.url)) == [ITEM[1]]
        assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
        assert asyncio.run(round_trip(server.url_for("worker", "w0rker"))) == [ITEM[1]]
        with pytest.raises(StoreUnavailable, match="Authentication"):
            asyncio.run(round_trip(server.url_for("worker", "wrong")))
        with pytest.raises(StoreUnavailable, match="AuthenticationError"):
            asyncio.run(round_trip(f"redis://127.0.0.1:{server.port}/0"))
        assert server.redis_cli("exists", f"pdserve:kv:{NS}:{ITEM[0][:16].hex()}").strip() == "1"
    finally:
        server.stop()


def test_an_acl_user_limited_to_other_keys_is_refused(tmp_path):
    """A user whose ACL leaves out pdserve's keys: every call fails as unavailable."""
    other = ACLUser("other", "0ther", ("~elsewhere:*", "+@all"))
    server = RedisServer(tmp_path / "acl", users=[other]).start()
    try:
        with pytest.raises(StoreUnavailable, match="permission"):
            asyncio.run(round_trip(server.url_for("other", "0ther")))
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
