"""Shared fixtures."""

from __future__ import annotations

import pytest

from rolloutstore import RolloutStore


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    return RolloutStore.open(tmp_path / "store")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real model of the slow tests (SmolLM2-135M-Instruct, float32), built by
    ``make smollm2`` (which ``make test`` runs first). A missing folder fails, never skips.
    ``SMOLLM2_DIR`` names another folder (a second checkout reusing the first one's model)."""
    import os
    from pathlib import Path

    from helpers import ROOT

    path = Path(os.environ.get("SMOLLM2_DIR") or ROOT / ".cache" / "smollm2" / "fp32")
    if not (path / "build.json").is_file():
        pytest.fail(f"no SmolLM2 model at {path}: run `make smollm2` (tools/make_smollm2.py)")
    return path


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1; yields its URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint) -> tuple[str, dict[str, str]]:
    """A fresh bucket on the moto server: (``s3://BUCKET``, Lance storage options)."""
    import uuid

    import pyarrow.fs as pafs

    bucket = f"t-{uuid.uuid4().hex[:16]}"
    pafs.S3FileSystem(
        access_key="testing",
        secret_key="testing",
        endpoint_override=s3_endpoint,
        region="us-east-1",
        allow_bucket_creation=True,
    ).create_dir(bucket)
    options = {
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "aws_endpoint": s3_endpoint,
        "aws_region": "us-east-1",
        "allow_http": "true",
    }
    return f"s3://{bucket}", options


@pytest.fixture
def keep_torch_threads():
    """The test's torch thread count restored after it (the replay sweep sets 1 per run)."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
