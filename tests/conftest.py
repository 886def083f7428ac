"""Test set-up: 8 fake CPU devices for sharding tests; GPU tests skipped where there is no GPU."""

import os
import zlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402  (the flag must be set before jax initialises its backends)
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _gpu_available() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs through benchmarks/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh, test-specific random generator (seeded from the test's name, so runs repeat)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))  # hash() of a str varies per process
