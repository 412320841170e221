"""Shared test set-up: GPU-marked tests skip without a GPU; fresh random generators."""

import numpy as np
import pytest

from tinyvllm_lib.runtime import has_gpu


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A generator seeded from the OS: every run draws fresh inputs (the seed is printed on failure)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)
