"""The basic round trip: a function runs remotely with its GPUs visible and its value comes back."""

from __future__ import annotations


def test_value_comes_back_with_the_granted_gpus_visible(server, connect):
    conn = connect(server("pytorch", "fake:2"))

    def job(x):
        import os

        return x * 2, os.environ["CUDA_VISIBLE_DEVICES"], os.environ["CUDA_DEVICE_ORDER"]

    value, visible, order = conn.root.run_code(job, 21, ngpus=2)
    assert value == 42
    assert visible == "0,1"
    assert order == "PCI_BUS_ID"
