"""Shared fixtures."""

from __future__ import annotations

import pytest

from rolloutstore import RolloutStore


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    return RolloutStore.open(tmp_path / "store")
