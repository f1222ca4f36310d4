import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Modules that start real Prometheus, systemd-style watchdogs and packet forwarders with margins
# of a second or less: run one after another on one xdist worker, not beside each other, when
# the suite runs in parallel (scripts/test.sh).
HOST_BOUND = {"test_ops", "test_netfaults"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marker (it runs first otherwise)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in HOST_BOUND:
            item.add_marker(pytest.mark.xdist_group("host"))
