from __future__ import annotations

import pytest
import torch
import torch._dynamo


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test compiles from scratch: no guard or cache from an earlier test hides a compile."""
    torch._dynamo.reset()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
