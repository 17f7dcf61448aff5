"""The installed gRPC stubs are what proto/worker.proto generates now."""

from __future__ import annotations

from services.rpc import generate


def test_stubs_are_not_stale(tmp_path):
    written = generate.generate(tmp_path)
    for fresh in written:
        installed = generate.HERE / fresh.name
        assert installed.is_file(), f"{installed} missing: run `make install`"
        assert installed.read_text() == fresh.read_text(), (
            f"{installed.name} is stale: proto/worker.proto changed; run `make install`"
        )


def test_stubs_live_in_our_package_and_shadow_nothing():
    from services.rpc import worker_pb2, worker_pb2_grpc

    assert worker_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert worker_pb2_grpc.__name__ == "services.rpc.worker_pb2_grpc"
    assert "from . import worker_pb2" in (generate.HERE / "worker_pb2_grpc.py").read_text()
