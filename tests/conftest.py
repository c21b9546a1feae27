"""Shared pytest fixtures."""
import pytest
import torch


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (tiny tensors on 2 shared cores), restoring the count afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
