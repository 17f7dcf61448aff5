"""The gRPC stubs of proto/worker.proto (package pdserve.v1), generated at install time.

`python -m services.rpc.generate` writes worker_pb2.py, worker_pb2.pyi and worker_pb2_grpc.py
here; they are not in git. Import them from this package:

    from services.rpc import worker_pb2, worker_pb2_grpc
"""
