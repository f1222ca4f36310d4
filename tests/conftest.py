import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Modules that use the host's fixed names (the deployment's own paths and ports, /run/kvxferd,
# network namespaces, fd and memory limits): run one after another on one xdist worker, not
# beside each other, when the suite runs in parallel (scripts/test.sh).
HOST_BOUND = {"test_ops", "test_sockdir", "test_isolation", "test_exhaustion", "test_cli", "test_netfaults"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in HOST_BOUND:
            item.add_marker(pytest.mark.xdist_group("host"))
