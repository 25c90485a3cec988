"""Shared fixtures: tiny random checkpoints made on the fly (no model hub here)."""

from __future__ import annotations

import pytest

from rollout.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", seed=2)
