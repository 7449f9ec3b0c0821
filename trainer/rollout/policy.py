"""Policy sync: keeping a generator at the learner's weights, and verifying that it is.

Every loop uses these: the sync loop's :class:`LivePolicy` (the learner's state dict
copied into a transformers generator, or loaded into a running vLLM engine in place),
and the async actors' :class:`HFPolicy` / :class:`VLLMPolicy` (published folders loaded
as they appear). :func:`verify_logprobs` checks a generator's sampled-token log-probs
against a teacher-forced recomputation of the weights it should hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.algo.learner import Learner
from trainer.models.lora import has_lora
from trainer.rollout.sampling import GenerationConfig
from trainer.rollout.vllm_update import VERIFY_TOLERANCE, verify_tolerance  # no vLLM import
from trainer.rollout.weights import (
    Publisher,
    is_adapter_folder,
    load_published_model,
    model_folder,
    read_published,
)
from trainer.tasks import Task


class LivePolicy:
    """The sync loop's generator, kept at the learner's current weights.

    transformers: one model, the learner's state dict copied in. vLLM: the first
    version is published as a model folder and the engine started from it; later
    versions go from the learner's state dict into the running engine (no folder,
    no restart), and each is verified against a teacher-forced recomputation of the
    new weights. A failed check is logged and falls back to publishing the version
    and restarting the engine from it (see :class:`VLLMPolicy`).

    The transformers generator is built at the first sync, on the learner's device, in
    ``[generation].dtype`` (default the learner's ``[model].dtype``) and with the learner's
    attention implementation. A LoRA learner's weights arrive merged (``Learner.full_weights``);
    its published versions are adapter folders (trainer/rollout/weights.py), and the engine
    starts from the base model folder. ``trust_remote_code``: ``[model].trust_remote_code``, for
    either generator. ``publisher``: the run's retention and precision of published folders;
    ``threads``: ``[run] threads``, the cores the vLLM CPU engine binds while it generates.
    """

    def __init__(
        self,
        backend: str,
        generation: GenerationConfig,
        task: Task,
        model_dir: Path,
        weights_dir: Path,
        run_id: str,
        seed: int,
        *,
        trust_remote_code: bool = False,
        publisher: Publisher | None = None,
        threads: int | None = None,
        engine_log: Path | None = None,
    ):
        self.backend, self.model_dir, self.weights_dir = backend, model_dir, weights_dir
        self.run_id, self.trust_remote_code = run_id, trust_remote_code
        self.publisher = publisher or Publisher(Path(weights_dir).parent)
        self.gen = None
        self.version: int | None = None
        self.events: list[dict] = []  # vLLM: one per new version (verification and how loaded)
        self.generation = generation
        if backend != "hf":
            # Quiet: one line per generation round would drown the progress bar; a
            # failed verification (and its restart) is still printed.
            self.vllm = VLLMPolicy(
                generation, task, run_id, seed=seed, verbose=False,
                trust_remote_code=trust_remote_code, cpu_threads=threads, engine_log=engine_log,
            )  # fmt: skip

    def sync(self, learner: Learner, weights: dict[str, Any] | None = None):
        """The generator at the learner's weights (``weights``: its gathered, merged state
        dict, :meth:`Learner.full_weights`)."""
        v = learner.policy_version
        if weights is None:
            weights = learner.full_weights()
        if self.backend == "hf":
            if self.gen is None:
                self.gen = self._hf_generator(learner)
            self.gen.model.load_state_dict(weights)
            self.gen.policy_version = v
        elif self.version != v:
            # A LoRA learner publishes its adapters (FSDP-sharded ones: the merged weights).
            source = learner.model if has_lora(learner.model) and not learner.sharded else weights

            def publish() -> Path:
                return self.publisher.publish(self.weights_dir, v, source, self.model_dir)

            self.gen = self.vllm.update(v, weights, publish)
            self.events.append(
                {
                    "policy_version": v,
                    "max_logprob_gap": self.vllm.last_gap,
                    "engine_starts": self.vllm.restarts,
                    "in_place_updates": self.vllm.in_place,
                    **self.vllm.last_seconds,
                }
            )
        self.version = v
        return self.gen

    def _hf_generator(self, learner: Learner):
        from trainer.models.load import resolve_dtype
        from trainer.rollout.hf import HFGenerator

        device = learner.device
        return HFGenerator(
            self.model_dir,
            device=device,
            dtype=resolve_dtype(self.generation.dtype, device, key="[generation].dtype"),
            policy_version=0,
            policy_id=self.run_id,
            attn_implementation=getattr(learner.model.config, "_attn_implementation", None),
            trust_remote_code=self.trust_remote_code,  # [model].trust_remote_code
        )

    def close(self) -> None:
        if self.backend != "hf":
            self.vllm.close()


def actor_policy(
    backend: str,
    cfg: Any,
    task: Task,
    run_id: str,
    seed: int,
    *,
    threads: int | None = None,
    slot: int = 0,
    engine_log: Path | None = None,
) -> HFPolicy | VLLMPolicy:
    """An async actor's policy for ``backend`` from its run config (a TrainConfig): the
    generator runs as the sync loop's does, in ``[generation].dtype`` on ``[model].device``
    with the model's attention and ``trust_remote_code``; a vLLM CPU engine binds ``threads``
    cores, the ``slot``-th such share of the machine's (actor ``slot``)."""
    g, m = cfg.generation, cfg.model
    if backend == "vllm":
        return VLLMPolicy(
            g, task, run_id, seed=seed, trust_remote_code=m.trust_remote_code,
            cpu_threads=threads, cpu_slot=slot, engine_log=engine_log,
        )  # fmt: skip
    return HFPolicy(
        run_id, device=m.device, dtype=g.dtype, attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
    )  # fmt: skip


class HFPolicy:
    """HF backend: one generator for the actor's life, built from the first published folder
    (a complete model folder, so an actor needs no local model); later versions load in place.

    ``device`` / ``dtype``: ``[model].device`` and ``[generation].dtype`` (``auto`` as in
    :mod:`trainer.models.load`); the generator is built on that device, in that precision."""

    def __init__(
        self,
        run_id: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
    ):
        self.run_id, self.gen = run_id, None
        self.device, self.dtype = device, dtype
        self.attn_implementation, self.trust_remote_code = attn_implementation, trust_remote_code

    def load(self, version: int, folder: Path):
        if self.gen is None:
            self.gen = self._first(version, folder)
        else:
            state = read_published(
                folder, trust_remote_code=self.trust_remote_code
            )  # FileNotFoundError if pruned
            self.gen.model.load_state_dict(state, strict=True)
        self.gen.policy_version = version
        return self.gen

    def _first(self, version: int, folder: Path):
        """The generator, built from a private copy of ``folder``: a newer publish may prune
        the folder at any time, and building (config, tokenizer, weights) takes long enough
        for a learner to publish and prune several versions. A copy is quick; if the folder
        goes while it is copied, that is FileNotFoundError (the caller reads LATEST again)."""
        import shutil
        import tempfile

        from trainer.models.load import resolve_device, resolve_dtype
        from trainer.rollout.hf import HFGenerator

        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device, key="[generation].dtype")
        if is_adapter_folder(folder):  # adapters (read first: pruned -> FileNotFoundError)
            state = read_published(folder, trust_remote_code=self.trust_remote_code)
            gen = HFGenerator(
                model_folder(folder), policy_version=version, policy_id=self.run_id,
                device=device, dtype=dtype, attn_implementation=self.attn_implementation,
                trust_remote_code=self.trust_remote_code,
            )  # fmt: skip
            gen.model.load_state_dict(state, strict=True)
            return gen
        with tempfile.TemporaryDirectory(prefix="actor-weights-") as tmp:
            copy = Path(tmp) / folder.name
            try:
                shutil.copytree(folder, copy)
            except (FileNotFoundError, shutil.Error) as exc:
                raise FileNotFoundError(f"published weights {folder} were pruned") from exc
            if not all((copy / f).is_file() for f in ("config.json", "model.safetensors")):
                raise FileNotFoundError(f"published weights {folder} were pruned")
            return HFGenerator(
                copy, policy_version=version, policy_id=self.run_id, device=device, dtype=dtype,
                attn_implementation=self.attn_implementation,
                trust_remote_code=self.trust_remote_code,
            )  # fmt: skip

    def close(self) -> None:
        pass


class VLLMPolicy:
    """vLLM backend: one engine per actor life; each new version is loaded in place, verified.

    The first version starts the engine from its published folder (checked by
    verify_logprobs). Later versions are loaded into the running engine
    (VLLMGenerator.update_weights, see trainer/rollout/vllm_update.py), after which a few sampled
    tokens' log-probs (on the task's prompts, rendered as the run renders them) must match a
    teacher-forced recomputation of the new weights within the engine's verify_tolerance (its
    dtype's: max gap <= 1e-3 in float32, clipped mean gap <= 0.2 in bf16;
    trainer/rollout/vllm_update.py says why). An update that fails this check is logged and
    the engine restarted from the folder, which is verified again; a mismatch there stops the
    actor. The engine takes its settings from ``[generation]`` (GenerationConfig.engine_options)
    and ``trust_remote_code`` (``[model].trust_remote_code``) from the caller; ``cpu_threads`` /
    ``cpu_slot`` the cores a CPU engine binds, ``engine_log`` where its output goes
    (trainer/rollout/vllm_env.py).
    """

    def __init__(
        self,
        generation: GenerationConfig,
        task: Task,
        run_id: str,
        seed: int,
        *,
        verbose: bool = True,
        trust_remote_code: bool = False,
        cpu_threads: int | None = None,
        cpu_slot: int = 0,
        engine_log: Path | None = None,
    ):
        self.generation, self.task, self.run_id = generation, task, run_id
        self.seed, self.verbose = seed, verbose
        self.trust_remote_code = trust_remote_code
        self.cpu_threads, self.cpu_slot = cpu_threads, cpu_slot
        # [generation].engine_log = "quiet": the engine's output goes to this file.
        self.engine_log = engine_log if generation.engine_log == "quiet" else None
        self.gen = None
        self.last_gap: float | None = None  # of the newest verification
        self.restarts = 0  # engine starts, the first included
        self.in_place = 0  # versions loaded into the running engine
        self.last_seconds: dict[str, float] = {}  # the newest in-place update's parts

    def load(self, version: int, folder: Path):
        """Load the published ``folder`` of ``version`` (FileNotFoundError if it was pruned)."""
        if self.gen is None:
            return self._restart(version, folder)
        state = read_published(folder, trust_remote_code=self.trust_remote_code)
        return self.update(version, state, lambda: folder)

    def update(self, version: int, state: dict, folder):
        """Load ``state`` in place; ``folder()`` publishes it for the restart fallback."""
        from trainer.rollout.vllm_update import WeightUpdateError

        if self.gen is None:
            return self._restart(version, folder(), state)
        try:
            u = self._update_verified(version, state)
        except WeightUpdateError as exc:
            print(f"policy version {version}: {exc}; restarting the engine", flush=True)
            return self._restart(version, folder(), state)
        self.last_gap = u.gap
        self.last_seconds = {
            "transfer_seconds": u.update_seconds,
            "verify_seconds": u.verify_seconds,
        }
        self.in_place += 1
        if self.verbose:
            print(
                f"policy version {version}: updated in place and verified (max log-prob gap "
                f"{u.gap:.1e}; load {u.update_seconds:.2f} s, verify {u.verify_seconds:.2f} s)",
                flush=True,
            )
        return self.gen

    def _update_verified(self, version: int, state: dict):
        s = self.generation.sampling()
        return self.gen.update_weights(
            state, policy_version=version, verify_prompts=verify_texts(self.gen, self.task, 2),
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
        )  # fmt: skip

    def _restart(self, version: int, folder: Path, state: dict | None = None):
        from trainer.rollout.vllm import VLLMGenerator

        self.close()
        # An adapter folder: the engine starts from its base and gets the merged weights in
        # place (verified there); the adapters are read first, so a pruned folder fails early.
        # ``state``: the version's full weights when the caller holds them (the sync learner:
        # then no copy of the base is read or cached in its process).
        if not is_adapter_folder(folder):
            state = None
        elif state is None:
            state = read_published(folder, trust_remote_code=self.trust_remote_code)
        self.gen = VLLMGenerator(
            model_folder(folder),
            policy_version=version,
            policy_id=self.run_id,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            cpu_threads=self.cpu_threads,
            cpu_slot=self.cpu_slot,
            engine_log=self.engine_log,
            **self.generation.engine_options(),
        )
        self.restarts += 1
        self.last_seconds = {}  # an engine start: its time is the whole sync's
        if state is not None:
            self.last_gap = self._update_verified(version, state).gap
        else:
            self.last_gap = verify_logprobs(
                self.gen, folder, self.generation, self.task,
                trust_remote_code=self.trust_remote_code,
            )  # fmt: skip
        if self.verbose:
            print(
                f"policy version {version}: engine started from {folder} and verified "
                f"(max log-prob gap {self.last_gap:.1e})",
                flush=True,
            )
        return self.gen

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()
            self.gen = None


def verify_texts(gen: Any, task: Task, prompts: int) -> list[str]:
    """The verification prompts: ``prompts`` of the task's own, rendered as the run renders
    them (its chat template mode, the generator's tokenizer), so that the check samples the
    text the engine will be asked to continue."""
    from trainer.tasks.chat import render_prompts

    made = task.make_prompts(prompts, seed=123_457)
    tokenizer = getattr(gen, "tokenizer", None)
    mode = getattr(task, "chat_template", "auto") if tokenizer is not None else False
    return [p.prompt_text for p in render_prompts(tokenizer, made, mode)]


def verify_logprobs(
    gen: Any,
    folder: Path,
    generation: GenerationConfig,
    task: Task,
    prompts: int = 2,
    *,
    trust_remote_code: bool = False,
) -> float:
    """Largest |generator log-prob - teacher-forced log-prob| (float32) on a few samples; raises
    if above the generator's tolerance (its dtype's, VERIFY_TOLERANCE for float32)."""
    from trainer.rollout.hf import logprob_gaps

    g = generation
    texts = verify_texts(gen, task, prompts)
    rows = gen.generate(texts, **g.sampling(group_size=2, seed=0).kwargs())
    model, _ = load_published_model(folder, trust_remote_code=trust_remote_code)
    gaps = logprob_gaps(model, rows)
    dtype = getattr(gen, "dtype", None)
    statistic, tol = ("max", VERIFY_TOLERANCE) if dtype is None else verify_tolerance(dtype)
    if not gaps[statistic] <= tol:
        raise RuntimeError(
            f"generator log-probs differ from the teacher-forced ones of {folder} by "
            f"{gaps[statistic]:.2e} ({statistic.replace('_', ' ')} gap > {tol}); refusing to "
            "generate with weights it may not hold"
        )
    return gaps["max"]
