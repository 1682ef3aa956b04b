"""Shared fixtures of the privfl tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: the small models of these tests run faster without intra-op threads, and shared cores do
    not oversubscribe."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
