"""The multi-host bed's stack (`make test-multihost`): the router, 2 prefill workers, 2 decode
workers and Redis, each on a host of its own (a network namespace, tests/support/netbed.py),
every host's link at LINK. Skipped, with one line saying why, outside `make test-multihost`
or where no bed can be made (not root, no iproute2, no network namespaces).

The fixtures `pool` and `router` are the bed's here, so that the black-box API tests of
tests/router run unchanged across hosts (test_api.py imports them)."""

from __future__ import annotations

import os

import pytest

from tests.support.bed_stack import HOSTS, BedStack
from tests.support.netbed import Bed, Link, unavailable

LINK = Link(rate_bit=1e9)  # each host's, both ways
WORKER_ARGS = ["--num-blocks", "400", "--store-timeout", "1"]
# a host that stops answering is left out within ~5 s; a request waits 10 s for one; a
# Prefill taking 5 s is tried elsewhere (every one here takes well under a second)
ROUTER_ARGS = ["--health-interval", "0.5", "--health-timeout", "2", "--health-failures", "2",
               "--retry-wait", "10", "--prefill-timeout", "5"]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    ours = [item for item in items if str(item.fspath).startswith(here)]
    if not ours:
        return
    if os.environ.get("PDSERVE_MULTIHOST_TESTS") != "1":
        why = "multi-host bed: make test-multihost"
    else:
        why = unavailable()
    if why is not None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def bed_stack(embedded_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("bed-logs")
    with Bed(HOSTS) as bed:
        for host in HOSTS:
            bed.shape(host, LINK)
        stack = BedStack(bed, str(embedded_dir), logs)
        stack.start(2, 2, WORKER_ARGS, ROUTER_ARGS)
        try:
            yield stack
        finally:
            stack.stop()


@pytest.fixture(scope="session")
def pool(bed_stack):
    return bed_stack.prefill, bed_stack.decode


@pytest.fixture(scope="session")
def router(bed_stack):
    return bed_stack.router
