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

A LoRA learner (``[model.lora]``, a module with adapters) publishes only its adapters: the
folder holds ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's format) and
``base.json``, which names the base model folder and its fingerprint (sha256 of its weight
files), never a copy of the base. Readers go through :func:`read_published` (the full weights,
adapters merged into the base in memory) and :func:`model_folder` (the folder a generator starts
from: config, tokenizer, base weights), so a LoRA version costs adapter-sized disk, and version 0
(zero ``lora_B``) is in effect a reference to the base.

Weights are written in the run's precision (``dtype``: a bfloat16 run publishes bfloat16 files;
the learner's float32 master weights stay in its checkpoints). ``keep`` versions are kept
(``[run] keep_weight_versions``), plus those named in ``protect`` (the versions the run's
checkpoints hold); LATEST is always among the kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import torch
from safetensors.torch import load_file, save_file

from trainer.models.lora import generator_state, has_lora, merge_adapter, save_adapter

VERSION_FMT = "v-{:09d}"
BASE_FILE = "base.json"  # an adapter folder's reference to its base model folder
DONE_FILE = "policy_version.json"  # written last into every published folder


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
    dtype: torch.dtype | None = None,
    protect: Collection[int] = (),
) -> Path | str:
    """Publish ``model`` (or its state dict) as policy ``version``, then ``LATEST``: a loadable
    model folder, or for a module with LoRA adapters an adapter folder referring to
    ``template`` (see the module docstring; a state dict is always published whole).

    ``template``: the model folder (config, tokenizer; a LoRA run's base) whose files are
    copied beside full weights (so the folder loads with ``from_pretrained`` and in vLLM).
    ``dtype``: the precision the weights are written in (None: as they are). ``keep``: versions
    kept (0: all), besides ``protect``. ``weights_dir`` may be an object-store URI.
    """
    write = _writer(version, model, template, dtype)
    if is_remote(weights_dir):
        return _publish_remote(
            str(weights_dir), version, write, keep=keep, protect=protect, options=storage_options
        )
    root = Path(weights_dir)
    path = atomic_dir(root / VERSION_FMT.format(version), write)
    tmp = root / f".LATEST-{uuid.uuid4().hex[:8]}"
    tmp.write_text(f"{version}\n")
    os.replace(tmp, root / "LATEST")
    names = [p.name for p in root.iterdir() if p.name.startswith("v-") and p.is_dir()]
    for old in pruned(names, keep, protect, version):
        shutil.rmtree(root / old, ignore_errors=True)
    return path


def pruned(names: list[str], keep: int, protect: Collection[int], latest: int) -> list[str]:
    """The version folders (``v-…`` names) retention removes: all but the newest ``keep``,
    the ``protect``-ed versions and ``latest`` (the one LATEST names); none when ``keep`` is 0."""
    if keep <= 0:
        return []
    versions = sorted(names)
    kept = set(versions[-keep:]) | {VERSION_FMT.format(v) for v in (*protect, latest)}
    return [n for n in versions if n not in kept]


@dataclass(frozen=True)
class Publisher:
    """A run's publishing settings: ``publish(weights_dir, version, model, template)`` in the
    run's precision, keeping ``keep`` versions and those the run's checkpoints hold."""

    run_dir: Path
    keep: int = 3
    dtype: torch.dtype | None = None
    storage_options: dict[str, str] | None = None

    def publish(self, weights_dir, version: int, model, template=None) -> Path | str:
        return publish_weights(
            weights_dir, version, model, template=template, keep=self.keep, dtype=self.dtype,
            storage_options=self.storage_options, protect=checkpoint_versions(self.run_dir),
        )  # fmt: skip


def checkpoint_versions(run_dir: str | os.PathLike) -> set[int]:
    """The policy versions of the checkpoints in ``run_dir/checkpoints`` (their state.json):
    published versions retention never removes, so a resume finds the weights it left."""
    versions = set()
    for state in Path(run_dir).glob("checkpoints/step-*/state.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            versions.add(int(json.loads(state.read_text())["policy_version"]))
    return versions


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


def _writer(version: int, model, template, dtype: torch.dtype | None):
    """``write(folder)``: the files of one published version (adapters for a LoRA module)."""
    adapters = isinstance(model, torch.nn.Module) and has_lora(model)
    if adapters and template is None:
        raise ValueError("a LoRA model is published as adapters: pass template= (its base folder)")

    def write(tmp: Path) -> None:
        if adapters:
            base = Path(template).resolve()
            save_adapter(tmp, model, str(base), dtype)
            ref = {"base": str(base), "fingerprint": base_fingerprint(base)}
            (tmp / BASE_FILE).write_text(json.dumps(ref, indent=2))
        else:
            if template is not None:
                for f in Path(template).iterdir():
                    if (
                        f.is_file()
                        and not f.name.endswith((".safetensors", ".bin"))
                        and (f.name != "model.safetensors.index.json")
                    ):
                        shutil.copy2(f, tmp / f.name)
            tensors = published_tensors(model)
            if dtype is not None:
                tensors = {
                    k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()
                }
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / DONE_FILE).write_text(json.dumps({"policy_version": version}))

    return write


_FINGERPRINTS: dict[tuple, str] = {}  # (folder, its files' sizes and mtimes) -> sha256


def base_fingerprint(folder: str | os.PathLike) -> str:
    """sha256 over the weight files (``*.safetensors``) of a model folder; computed once per
    process for an unchanged folder (a 135M float32 model: ~1-2 s)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    key = (
        str(Path(folder).resolve()),
        *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files),
    )
    if key not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    digest.update(chunk)
        _FINGERPRINTS[key] = digest.hexdigest()
    return _FINGERPRINTS[key]


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    """Whether a published folder holds LoRA adapters (and a reference to its base)."""
    return (Path(folder) / BASE_FILE).is_file()


def model_folder(folder: str | os.PathLike) -> Path:
    """The model folder a generator starts from for a published ``folder``: the folder itself,
    or an adapter folder's base (checked against its fingerprint: ValueError if it changed)."""
    folder = Path(folder)
    if not is_adapter_folder(folder):
        return folder
    try:
        ref = json.loads((folder / BASE_FILE).read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"published weights {folder} were pruned") from exc
    base = Path(ref["base"])
    if not base.is_dir():
        raise ValueError(
            f"{folder} holds LoRA adapters for the base model {base}, which is not on this "
            "machine: put the base model folder at that path"
        )
    if base_fingerprint(base) != ref["fingerprint"]:
        raise ValueError(
            f"{folder} holds LoRA adapters for the base model {base}, whose weights have "
            "changed since (fingerprint mismatch): restore the base the run trained on"
        )
    return base


_BASE_STATES: dict[str, dict[str, torch.Tensor]] = {}  # one base per process: a run's


def read_published(
    folder: str | os.PathLike, *, trust_remote_code: bool = False
) -> dict[str, torch.Tensor]:
    """The full weights of a published folder, under the model's names: its tensors, or its
    base's with the adapters merged in (the learner's :meth:`Learner.full_weights`; the base
    is loaded with ``[model].trust_remote_code``). FileNotFoundError if it was pruned."""
    folder = Path(folder)
    if not is_adapter_folder(folder):
        return load_file(str(folder / "model.safetensors"))
    base = model_folder(folder)
    key = f"{base}:{base_fingerprint(base)}"
    if key not in _BASE_STATES:
        from trainer.models.load import load_model

        # float32, tied weights under both names
        model, _ = load_model(base, trust_remote_code=trust_remote_code)
        _BASE_STATES.clear()
        _BASE_STATES[key] = {k: v.detach() for k, v in model.state_dict().items()}
    try:
        return merge_adapter(_BASE_STATES[key], folder)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"published weights {folder} were pruned") from exc


def load_published_model(folder: str | os.PathLike, **kwargs) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) of a published folder, adapters merged (float32 unless ``dtype=``)."""
    from trainer.models.load import load_model

    model, tok = load_model(model_folder(folder), **kwargs)
    if is_adapter_folder(folder):
        state = read_published(folder, trust_remote_code=kwargs.get("trust_remote_code", False))
        model.load_state_dict(state, strict=True)
    return model, tok


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


def _publish_remote(uri: str, version: int, write, *, keep: int, protect, options) -> str:
    import tempfile

    fs, root = object_fs(uri, options)
    name = VERSION_FMT.format(version)
    with tempfile.TemporaryDirectory(prefix="weights-") as tmp:
        write(Path(tmp))
        # Every file of the version is uploaded before LATEST names it.
        pafs.copy_files(tmp, f"{root}/{name}", destination_filesystem=fs)
    write_text(uri, "LATEST", f"{version}\n", options)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    names = [i.base_name for i in infos if i.base_name.startswith("v-")]
    for old in pruned(names, keep, protect, version):
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
    if (local / DONE_FILE).exists():
        return local
    fs, path = object_fs(uri, storage_options)
    info = fs.get_file_info(f"{path}/{DONE_FILE}")
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"no published weights at {uri}")

    def download(tmp: Path) -> None:
        pafs.copy_files(path, str(tmp), source_filesystem=fs)

    return atomic_dir(local, download)
