"""Published weights: how a learner hands each policy version to its generators.

Each version is written to a temporary folder and renamed into place, one folder per policy
version under
``RUN_DIR/weights/v-000123/`` (``model.safetensors`` + ``config.json`` +
tokenizer files, a folder `from_pretrained` and vLLM load directly), and a
``LATEST`` file names the newest one (written to a temp file, then renamed).

The weights location may also be an object-store URI (``s3://bucket/run/weights``,
through ``pyarrow.fs``): a version's files are uploaded first and ``LATEST`` last,
one PUT that readers see whole or not at all; actors on other machines poll
``LATEST`` and download a version once into a local cache (:func:`fetch_weights`).
Storage options use Lance's keys (``aws_access_key_id``, ``aws_endpoint``, ...), so
one dict serves the store and the weights; without them the AWS_* environment is used.

A LoRA learner (``[model.lora]``) publishes merged full weights under the base model's names
(:func:`trainer.models.lora.generator_state`), so every generator, a vLLM actor included, loads
a published folder as a normal model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import pyarrow.fs as pafs
import torch
from safetensors.torch import save_file

from trainer.models.lora import generator_state, has_lora

VERSION_FMT = "v-{:09d}"


def atomic_dir(final: Path, write) -> Path:
    """Call ``write(tmp_dir)`` then rename ``tmp_dir`` to ``final`` (replacing nothing)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        fsync_dir(tmp)
        if final.exists():  # an identical step re-saved after a resume
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # A mapping is an already-gathered state dict (FSDP: Learner.full_weights on rank 0).
    state = model if isinstance(model, Mapping) else model.state_dict()
    # safetensors refuses shared storage (tied embeddings): clone to be safe.
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def published_tensors(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """What a published folder holds: a module's generator weights (LoRA merged), or a state
    dict as given; ValueError for a state dict that still holds adapter tensors."""
    if isinstance(model, Mapping):
        if has_lora(model):
            raise ValueError(
                "these weights hold LoRA adapter tensors: publish the merged weights "
                "(Learner.full_weights() or trainer.models.lora.generator_state(model))"
            )
        return state_tensors(model)
    return state_tensors(generator_state(model))


def publish_weights(
    weights_dir: str | os.PathLike,
    version: int,
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    template: str | os.PathLike | None = None,
    keep: int = 3,
    storage_options: dict[str, str] | None = None,
) -> Path | str:
    """Publish ``model`` (or its state dict) as policy ``version``: a loadable model folder,
    then ``LATEST``. A module with LoRA adapters is published merged (:func:`published_tensors`).

    ``template``: a model folder whose config and tokenizer files are copied beside
    the weights (so the folder loads with ``from_pretrained`` and in vLLM).
    ``weights_dir`` may be an object-store URI (see the module docstring).
    """
    if is_remote(weights_dir):
        return _publish_remote(
            str(weights_dir), version, model, template=template, keep=keep, options=storage_options
        )
    root = Path(weights_dir)
    path = atomic_dir(
        root / VERSION_FMT.format(version),
        lambda tmp: _write_weights(tmp, version, model, template),
    )
    tmp = root / f".LATEST-{uuid.uuid4().hex[:8]}"
    tmp.write_text(f"{version}\n")
    os.replace(tmp, root / "LATEST")
    versions = sorted(p for p in root.iterdir() if p.name.startswith("v-") and p.is_dir())
    for old in versions[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def latest_weights(
    weights_dir: str | os.PathLike, storage_options: dict[str, str] | None = None
) -> tuple[int, Path | str] | None:
    """(version, folder) of the newest published weights, or None.

    For an object-store ``weights_dir`` the folder is a URI: pass it to :func:`fetch_weights`.
    """
    text = read_text(weights_dir, "LATEST", storage_options)
    try:
        version = int((text or "").strip())
    except ValueError:
        return None
    name = VERSION_FMT.format(version)
    if is_remote(weights_dir):
        return version, str(weights_dir).rstrip("/") + "/" + name
    return version, Path(weights_dir) / name


def _write_weights(tmp: Path, version: int, model: torch.nn.Module, template) -> None:
    if template is not None:
        for f in Path(template).iterdir():
            if (
                f.is_file()
                and not f.name.endswith((".safetensors", ".bin"))
                and (f.name != "model.safetensors.index.json")
            ):
                shutil.copy2(f, tmp / f.name)
    save_file(published_tensors(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "policy_version.json").write_text(json.dumps({"policy_version": version}))


# Lance storage-option keys -> pyarrow.fs.S3FileSystem arguments.
_S3_KEYS = {
    "aws_access_key_id": "access_key",
    "access_key_id": "access_key",
    "aws_secret_access_key": "secret_key",
    "secret_access_key": "secret_key",
    "aws_session_token": "session_token",
    "session_token": "session_token",
    "aws_endpoint": "endpoint_override",
    "aws_endpoint_url": "endpoint_override",
    "endpoint": "endpoint_override",
    "aws_region": "region",
    "region": "region",
}


def is_remote(uri: str | os.PathLike) -> bool:
    """True for an object-store URI (``s3://``, ``gs://``, ...), False for a local path."""
    uri = os.fspath(uri)
    return "://" in uri and not uri.startswith("file://")


def object_fs(
    uri: str, storage_options: dict[str, str] | None = None
) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for an object-store URI.

    ``s3://`` takes Lance-style storage options (keys are case-insensitive, as in
    Lance; keys for the store only, e.g. ``allow_http``, are ignored here); other
    schemes use ``pyarrow.fs.FileSystem.from_uri`` and the environment's credentials.
    """
    if not uri.startswith("s3://"):
        return pafs.FileSystem.from_uri(uri)
    kwargs = {}
    for key, value in (storage_options or {}).items():
        arg = _S3_KEYS.get(key.lower())
        if arg is not None:
            kwargs[arg] = value
    return pafs.S3FileSystem(**kwargs), uri.removeprefix("s3://").rstrip("/")


def read_text(root: str | os.PathLike, name: str, storage_options=None) -> str | None:
    """The text of ``root/name`` (a local folder or an object-store URI), or None if absent."""
    if not is_remote(root):
        try:
            return (Path(root) / name).read_text()
        except FileNotFoundError:
            return None
    fs, path = object_fs(str(root), storage_options)
    try:
        with fs.open_input_stream(f"{path}/{name}") as f:
            return f.read().decode()
    except FileNotFoundError:
        return None


def write_text(root: str | os.PathLike, name: str, text: str, storage_options=None) -> None:
    """Write ``root/name`` whole: a temp file renamed locally, one PUT on an object store."""
    if not is_remote(root):
        Path(root).mkdir(parents=True, exist_ok=True)
        tmp = Path(root) / f".{name}-{uuid.uuid4().hex[:8]}"
        tmp.write_text(text)
        os.replace(tmp, Path(root) / name)
        return
    fs, path = object_fs(str(root), storage_options)
    with fs.open_output_stream(f"{path}/{name}") as f:
        f.write(text.encode())


def remove_text(root: str | os.PathLike, name: str, storage_options=None) -> None:
    """Delete ``root/name`` if it exists."""
    if not is_remote(root):
        (Path(root) / name).unlink(missing_ok=True)
        return
    fs, path = object_fs(str(root), storage_options)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(f"{path}/{name}")


def _publish_remote(uri: str, version: int, model, *, template, keep: int, options) -> str:
    import tempfile

    fs, root = object_fs(uri, options)
    name = VERSION_FMT.format(version)
    with tempfile.TemporaryDirectory(prefix="weights-") as tmp:
        _write_weights(Path(tmp), version, model, template)
        # Every file of the version is uploaded before LATEST names it.
        pafs.copy_files(tmp, f"{root}/{name}", destination_filesystem=fs)
    write_text(uri, "LATEST", f"{version}\n", options)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    versions = sorted(i.base_name for i in infos if i.base_name.startswith("v-"))
    for old in versions[:-keep] if keep > 0 else []:
        with contextlib.suppress(OSError):
            fs.delete_dir(f"{root}/{old}")
    return f"{uri.rstrip('/')}/{name}"


def fetch_weights(
    folder: str | os.PathLike, cache_dir: str | os.PathLike, storage_options=None
) -> Path:
    """A local copy of a published weights folder (local folders are returned as they are).

    Downloaded once into ``cache_dir/v-.../`` (to a temp folder, then renamed); raises
    FileNotFoundError if the version was pruned meanwhile (read LATEST again).
    """
    if not is_remote(folder):
        return Path(folder)
    uri = str(folder).rstrip("/")
    local = Path(cache_dir) / uri.rsplit("/", 1)[-1]
    if (local / "model.safetensors").exists():
        return local
    fs, path = object_fs(uri, storage_options)
    info = fs.get_file_info(f"{path}/model.safetensors")
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"no published weights at {uri}")

    def download(tmp: Path) -> None:
        pafs.copy_files(path, str(tmp), source_filesystem=fs)

    return atomic_dir(local, download)
