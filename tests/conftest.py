"""Test configuration: `cuda` tests need a GPU and the compiled extension, and skip otherwise."""
import pytest
import torch

import atlas


def pytest_collection_modifyitems(config, items):
    if atlas.kernels_available():
        return
    why = ("no CUDA device" if not torch.cuda.is_available()
           else "atlas._C not built")
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU and atlas._C ({why})")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

