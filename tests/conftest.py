from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in its interpreter (on CPU tensors). This must be set before
# anything imports triton (Dynamo and Inductor do); `import torch` does not.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402
import torch._functorch.config  # noqa: E402

# AOTAutograd's cache is keyed by the graph Dynamo hands over: a test compiling a graph an earlier
# test compiled would be served its joint stage (no passes to count), or another test's patched
# pass's. Tests of the cache turn it on with a cache directory of their own.
torch._functorch.config.enable_autograd_cache = False

# Under pytest-xdist (``make test`` runs a worker per core) each worker computes on its share of
# the cores: torch's default, a thread per core in every worker, oversubscribes them.
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


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
