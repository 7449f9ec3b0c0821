"""Atomic checkpoints and published weights.

A checkpoint is a folder ``RUN_DIR/checkpoints/step-000123/`` holding

    model.safetensors   the weights (exact float bits)
    trainer.pt          optimizer + LR schedule state, torch / numpy / python RNG states
    state.json          step, policy_version, store version, loader/selector state, config
    manifest.json       name, size and sha256 of each file above; written last

It is written to a temporary sibling folder and renamed into place, so a crash
leaves either the previous checkpoint or the new one, never half of one; a save a
kill interrupted leaves a ``.tmp-step-*`` folder, removed when the run restarts
(:func:`remove_abandoned_saves`). The last ``keep`` checkpoints are kept. The weights
and the torch RNG state are stored once: where ``trainer_state`` holds the same weights
mapping (or an equal RNG state) ``trainer.pt`` holds a reference to them instead.

Resume reads the newest checkpoint that is whole (:func:`newest_good_checkpoint`): its
files match the manifest (checkpoints from before manifests: they load) and parse.
A damaged one is skipped with one warning line naming it; if none is usable, one
:class:`CheckpointError` line names every folder tried and why.

Weights for actors are published the same way, one folder per policy version under
``RUN_DIR/weights/v-000123/`` (``model.safetensors`` + ``config.json`` +
tokenizer files, a folder `from_pretrained` and vLLM load directly), and a
``LATEST`` file names the newest one (written to a temp file, then renamed).

The weights location may also be an object-store URI (``s3://bucket/run/weights``,
through ``pyarrow.fs``): a version's files are uploaded first and ``LATEST`` last,
one PUT that readers see whole or not at all; actors on other machines poll
``LATEST`` and download a version once into a local cache (:func:`fetch_weights`).
Storage options use Lance's keys (``aws_access_key_id``, ``aws_endpoint``, ...), so
one dict serves the store and the weights; without them the AWS_* environment is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch
from safetensors.torch import load_file, save_file

from rolloutstore.errors import RolloutStoreError

STEP_FMT = "step-{:09d}"
VERSION_FMT = "v-{:09d}"
MANIFEST = "manifest.json"
CHECKPOINT_FILES = ("model.safetensors", "trainer.pt", "state.json")
# What trainer.pt holds in place of a second copy of the weights / of the torch RNG state.
_WEIGHTS_REF = "<model.safetensors>"
_TORCH_RNG_REF = "<rng.torch>"


class CheckpointError(RolloutStoreError, ValueError):
    """A checkpoint folder is damaged (or none of a run's is usable); names the folder."""


def _atomic_dir(final: Path, write) -> Path:
    """Call ``write(tmp_dir)`` then rename ``tmp_dir`` to ``final`` (replacing nothing)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_dir(tmp)
        if final.exists():  # an identical step re-saved after a resume
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # A mapping is an already-gathered state dict (FSDP: Learner.full_weights on rank 0).
    state = model if isinstance(model, Mapping) else model.state_dict()
    # safetensors refuses shared storage (tied embeddings): clone to be safe.
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    trainer_state: dict[str, Any],
    state: dict[str, Any],
    keep: int = 3,
) -> Path:
    """Write checkpoint ``step`` atomically and drop all but the newest ``keep``.

    ``trainer_state`` may hold ``model`` itself (a state dict) and the torch RNG state
    (e.g. a learner's ``state_dict()``): both are written once, see the module docstring."""
    root = Path(run_dir) / "checkpoints"

    def write(tmp: Path) -> None:
        save_file(_state_tensors(model), str(tmp / "model.safetensors"))
        rng = rng_state()
        refs = _to_refs(trainer_state, model, rng["torch"])
        torch.save({**refs, "rng": rng}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))
        _write_manifest(tmp)

    path = _atomic_dir(root / STEP_FMT.format(step), write)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _to_refs(value: Any, weights: Any, torch_rng: torch.Tensor) -> Any:
    if value is weights:
        return _WEIGHTS_REF
    if isinstance(value, dict):
        return {k: _to_refs(v, weights, torch_rng) for k, v in value.items()}
    if (
        isinstance(value, torch.Tensor)
        and value.dtype == torch_rng.dtype
        and value.shape == torch_rng.shape
        and torch.equal(value, torch_rng)
    ):
        return _TORCH_RNG_REF
    return value


def _from_refs(value: Any, weights: Callable[[], dict], torch_rng: torch.Tensor) -> Any:
    if isinstance(value, str) and value == _WEIGHTS_REF:
        return weights()
    if isinstance(value, str) and value == _TORCH_RNG_REF:
        return torch_rng.clone()
    if isinstance(value, dict):
        return {k: _from_refs(v, weights, torch_rng) for k, v in value.items()}
    return value


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    """Flush every file, then record name, size and sha256 of each (a temp file, renamed)."""
    files = {}
    for name in CHECKPOINT_FILES:
        f = folder / name
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        files[name] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"format": 1, "files": files}, indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST)


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` if ``path``'s files do not match its manifest.

    A checkpoint without a manifest (written before manifests) passes: loading it decides."""
    path = Path(path)
    try:
        text = (path / MANIFEST).read_text()
    except FileNotFoundError:
        return
    try:
        files = json.loads(text)["files"]
        expected = {name: (int(f["size"]), str(f["sha256"])) for name, f in files.items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: {MANIFEST} is unreadable ({_one_line(exc)})") from exc
    for name, (size, digest) in expected.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing (the manifest lists it)")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{path}: {name} has {f.stat().st_size} bytes, the manifest says {size}"
            )
        if _sha256(f) != digest:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in the manifest")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read whole into memory (weights, trainer state with RNG, state.json)."""

    path: Path
    weights: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    state: dict[str, Any]

    def restore(self, model: torch.nn.Module | None) -> tuple[dict, dict]:
        """Load the weights into ``model`` (``None``: leave them to the caller, e.g. a sharded
        learner restoring from ``trainer_state``), set the RNG states; return
        (trainer_state, state) as :func:`load_checkpoint` does."""
        if model is not None:
            model.load_state_dict(self.weights, strict=True)
        trainer_state = dict(self.trainer_state)
        set_rng_state(trainer_state.pop("rng"))
        return trainer_state, self.state


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Verify and read checkpoint ``path``; :class:`CheckpointError` names it and the
    damaged file. Changes nothing (see :meth:`Checkpoint.restore`)."""
    path = Path(path)
    verify_checkpoint(path)

    def read(name: str, load: Callable[[Path], Any], kind: type) -> Any:
        try:
            value = load(path / name)
        except Exception as exc:  # any damage: truncated, empty, garbage, missing
            raise CheckpointError(f"{path}: {name} is unreadable ({_one_line(exc)})") from exc
        if not isinstance(value, kind):
            raise CheckpointError(
                f"{path}: {name} holds a {type(value).__name__}, not a {kind.__name__}"
            )
        return value

    weights = read("model.safetensors", lambda f: load_file(str(f)), dict)
    trainer_state = read("trainer.pt", lambda f: torch.load(f, weights_only=False), dict)
    state = read("state.json", lambda f: json.loads(f.read_text()), dict)
    rng = trainer_state.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        raise CheckpointError(f"{path}: trainer.pt holds no RNG state")
    if "step" not in state:
        raise CheckpointError(f"{path}: state.json names no step")
    trainer_state = _from_refs(trainer_state, lambda: weights, rng["torch"])
    return Checkpoint(path, weights, trainer_state, state)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step-") and p.is_dir())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def newest_good_checkpoint(
    run_dir: str | os.PathLike, *, warn: Callable[[str], None] | None = None
) -> Checkpoint | None:
    """The newest checkpoint of ``run_dir`` that verifies and reads (None: there are none).

    Each damaged newer one is reported by one ``warn`` line (default: stderr) naming it;
    if every checkpoint is damaged, :class:`CheckpointError` names each and why."""
    if warn is None:

        def warn(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

    tried = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            ckpt = read_checkpoint(path)
        except CheckpointError as exc:
            tried.append(str(exc))
            continue
        for bad in tried:
            warn(f"warning: skipping damaged checkpoint {bad}; resuming from {path.name}")
        return ckpt
    if tried:
        raise CheckpointError(
            f"no usable checkpoint in {Path(run_dir) / 'checkpoints'}: tried "
            + "; ".join(tried)
            + " (restore one from a backup, or start a new run in another folder)"
        )
    return None


def saved_state(run_dir: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """(folder, state.json) of the newest checkpoint whose state.json parses: a cheap look at
    what the run saved (no weights read or verified)."""
    for path in reversed(list_checkpoints(run_dir)):
        with contextlib.suppress(OSError, ValueError):
            state = json.loads((path / "state.json").read_text())
            if isinstance(state, dict):
                return path, state
    return None


def remove_abandoned_saves(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the ``.tmp-step-*`` folders saves that were killed left behind; return them.

    Call only while no save of this run can be in progress (at the start of train/resume)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    gone = sorted(p for p in root.iterdir() if p.name.startswith(".tmp-step-") and p.is_dir())
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None) -> tuple[dict, dict]:
    """Load weights into ``model`` (``None``: leave them to the caller, e.g. a sharded learner
    restoring from ``trainer_state``); return (trainer_state, state). Restores RNG states.

    Raises :class:`CheckpointError` (naming ``path``) if the checkpoint is damaged."""
    return read_checkpoint(path).restore(model)


# -- resume: the store as the uninterrupted run read it ---------------------------------------
class ResumeStoreView:
    """The store a sync run's replay loader reads until it has caught up with the store.

    A run killed after appending a round its newest usable checkpoint predates (a
    checkpoint between round boundaries, a fallback past a corrupt checkpoint, or no
    checkpoint yet) left rows in the store that the uninterrupted run had not yet seen
    when it took the steps the resumed run retakes. Up to its next round that run drew
    from the version recorded in the checkpoint (without one: the newest version holding
    none of the run's rows), and after each round from the version that round's last batch
    committed. :attr:`store` is a read-only snapshot at that version while the live store
    holds more, and the live store itself once the run has caught up (or never fell behind).
    """

    def __init__(self, live, run_id: str, state: dict[str, Any] | None):
        self.live, self.run_id = live, run_id
        quoted = run_id.replace("'", "''")
        self._own = f"run_id = '{quoted}'"
        version = state["store_version"] if state is not None else self._before_run()
        self.version = version if version is not None and live.version > version else None
        self.store = live if self.version is None else live.checkout(self.version)

    def _before_run(self) -> int | None:
        """The newest version holding none of this run's rows (None: none anywhere, or the
        versions from before the run's first append were cleaned up)."""
        if not self.live.count(self._own):
            return None
        versions = [v["version"] for v in self.live.versions()]
        lo, hi = 0, len(versions) - 1  # versions[hi] holds rows of the run
        if self.live.checkout(versions[lo]).count(self._own):
            return None
        while hi - lo > 1:  # versions[lo] holds none
            mid = (lo + hi) // 2
            if self.live.checkout(versions[mid]).count(self._own):
                hi = mid
            else:
                lo = mid
        return versions[lo]

    def after_round(self, policy_version: int) -> bool:
        """Move past the round this run generated at ``policy_version`` (all of it now in the
        live store); True when :attr:`store` changed (restart the loader's iterator)."""
        if self.version is None:
            return False
        rows = f"{self._own} AND policy_version = {int(policy_version)}"
        want, latest = self.live.count(rows), self.live.version
        later = [v["version"] for v in self.live.versions() if v["version"] >= self.version]
        v = next(v for v in later if v == latest or self.live.checkout(v).count(rows) == want)
        old, self.version = self.version, (v if v < latest else None)
        self.store = self.live if self.version is None else self.live.checkout(self.version)
        return self.version != old


# -- published weights (learner -> actors) -------------------------------------------------
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
    then ``LATEST``.

    ``template``: a model folder whose config and tokenizer files are copied beside
    the weights (so the folder loads with ``from_pretrained`` and in vLLM).
    ``weights_dir`` may be an object-store URI (see the module docstring).
    """
    if is_remote(weights_dir):
        return _publish_remote(
            str(weights_dir), version, model, template=template, keep=keep, options=storage_options
        )
    root = Path(weights_dir)
    path = _atomic_dir(
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
    save_file(_state_tensors(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "policy_version.json").write_text(json.dumps({"policy_version": version}))


# -- object-store weights ---------------------------------------------------------------------
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

    return _atomic_dir(local, download)
