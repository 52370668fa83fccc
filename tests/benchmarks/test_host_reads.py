"""The host-read counter (``benchmarks.host_reads``): what it counts is what waits for the device."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autoscale.mirror import HostMirror
from benchmarks.host_reads import HostReads


def test_blocking_copies_to_the_host_count_and_asynchronous_ones_do_not() -> None:
    """Fake CUDA tensors stand in for a GPU's. ``copy_`` reaches the dispatcher with
    ``non_blocking`` as a positional argument: the mirror's asynchronous copy was once counted."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        device, host = torch.empty(4, device="cuda"), torch.empty(4)
        with HostReads() as reads:
            host.copy_(device, non_blocking=True)
            device.to("cpu", non_blocking=True)
            device.add(1)  # (on the device: no read)
        assert reads.reads == []
        with HostReads() as reads:
            host.copy_(device)
            device.to("cpu")
            device.cpu()
        assert reads.reads == ["copy to host"] * 3


def test_value_reads_count_unless_they_are_a_mirrors() -> None:
    mirror = HostMirror()
    exempt = mirror.destination(2, torch.device("cpu"))
    mirror.post(exempt)
    (arrived,) = mirror.poll()
    t = torch.ones(3)
    with HostReads(exempt=mirror) as reads:
        t.sum().item()
        t.tolist()
        arrived.tolist()
        arrived[0].item()
    assert reads.reads == ["item", "tolist"]
