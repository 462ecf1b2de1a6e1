import os

import pytest

# A gateway started by a test without --processes runs as one process, as
# before the flag existed (its default is every core): tests that expect one
# cache, one set of limits and one /metrics keep their meaning. Tests of
# several processes pass --processes themselves.
os.environ.setdefault("HEDGEROW_GATEWAY_PROCESSES", "1")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
