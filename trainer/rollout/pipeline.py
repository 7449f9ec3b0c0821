"""The generate pipeline: task prompts -> sampled groups -> rewards, advantages, embeddings -> store.

:func:`generate_rollouts` draws ``prompts`` prompts from a task, samples ``group_size``
completions per prompt with the vLLM or transformers backend, scores each completion with the
task's verifiable reward, computes GRPO group advantages, embeds the completion token ids with
:class:`trainer.rollout.embed.HashingEmbedder` (``dim = store.embedding_dim``) and appends every batch of
prompts to the store as one atomic commit (a batch is either fully in the store or not at all).

Python::

    from rolloutstore import RolloutStore
    from trainer.rollout.pipeline import RoundIds, generate_rollouts
    from trainer.rollout.sampling import GenerationConfig

    store = RolloutStore.open("runs/x/store")
    summary = generate_rollouts(store, "runs/x/tiny-model", "arith", 256,
                                generation=GenerationConfig(backend="hf", group_size=8),
                                policy_version=0, ids=RoundIds(run_id="x", seed=0))
    print(summary.rollouts, summary.mean_reward, summary.tokens_per_s)

A round's rows are built here, once each: the ids first (deterministic under
``RoundIds.id_namespace``), then the columns the generator's :class:`Sample` decides, the
reward, the group advantage and the embedding. Generators return samples without ids.

CLI (registered on ``rolloutstore`` by :mod:`trainer.store_commands`)::

    rolloutstore-train generate STORE --model DIR|tiny --task arith --prompts 256 --group-size 8 \\
        --policy-version 0 --backend hf|vllm|auto [--temperature T --top-p P --top-k K \\
        --max-tokens N --seed S --run-id ID]

``--model tiny`` builds (once) a tiny random model for the task into ``STORE/../tiny-model``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rolloutstore.schema.ids import deterministic_uuid7
from trainer.algo.advantage import group_advantages
from trainer.rollout.embed import HashingEmbedder
from trainer.rollout.multiturn import samples_for_task
from trainer.rollout.sampling import (
    GenerationConfig,
    Sample,
    SamplingParams,
    _not_int,
    sample_columns,
)
from trainer.tasks import Prompt, Task, get_task, score_completion
from trainer.tasks.chat import fit_prompts, render_prompts

BACKENDS = ("vllm", "hf")
TINY_MODEL = "tiny"


class Generator(Protocol):
    """What :func:`generate_rollouts` needs from a backend (HFGenerator, VLLMGenerator): samples
    without ids (a task with tools: also ``sample``, trainer/rollout/multiturn.py), and what
    the rows record of the generator."""

    tokenizer: Any
    generator_name: str
    policy_version: int
    policy_id: str | None
    tokenizer_fingerprint: str

    def generate_samples(
        self,
        prompts: list[str],
        *,
        group_size: int,
        temperature: float = ...,
        top_p: float = ...,
        top_k: int = ...,
        max_tokens: int = ...,
        seed: int = ...,
    ) -> list[Sample]: ...


@dataclass(frozen=True)
class RoundIds:
    """Which round :func:`generate_rollouts` runs, fixed before anything is sampled.

    ``run_id``: what its rows record. ``policy_id``: what a generator built here records (a
    generator passed in records its own). ``seed``: the prompts (a count is drawn with
    ``task.make_prompts(n, seed)``) and the sampling (batch ``b``: ``seed + b``).
    ``id_namespace``: deterministic rollout and group ids derived from it (``id_time_ms`` is
    their UUIDv7 time field), so that a resumed round skips the batches already in the store
    and regenerates exactly what is missing; without one the store gives rollout ids and
    group ids are random.
    """

    run_id: str = "default"
    policy_id: str | None = None
    id_namespace: str | None = None
    id_time_ms: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError(f"run_id must be a non-empty str, got {self.run_id!r}")
        if self.id_namespace is not None and (
            not isinstance(self.id_namespace, str) or not self.id_namespace
        ):
            raise ValueError(
                f"id_namespace must be None or a non-empty str, got {self.id_namespace!r}"
            )
        for name in ("id_time_ms", "seed"):
            value = getattr(self, name)
            if _not_int(value) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    def rollout_ids(self, b: int, n: int) -> list[str] | None:
        """Rollout ids of batch ``b``'s ``n`` rows (None without a namespace: the store's)."""
        if self.id_namespace is None:
            return None
        return [
            deterministic_uuid7(f"{self.id_namespace}/b{b}/{k}", self.id_time_ms) for k in range(n)
        ]

    def group_ids(self, b: int, groups: int) -> list[str]:
        """Group ids of batch ``b``'s ``groups`` prompts (random without a namespace)."""
        if self.id_namespace is None:
            return [uuid.uuid4().hex for _ in range(groups)]
        return [f"{self.id_namespace}/b{b}/g{g}" for g in range(groups)]


@dataclass(frozen=True)
class GenerateSummary:
    """What one :func:`generate_rollouts` call wrote.

    ``tokens`` counts completion tokens; ``tokens_per_s`` is ``tokens / seconds`` with
    ``seconds`` the wall time of generation, scoring, embedding and appends (not building or
    stopping the backend). ``store_version`` is the store's version after the last append.
    ``rollouts``, ``tokens`` and ``mean_reward`` cover every batch of the call, also those an
    earlier (killed) call with the same ``id_namespace`` appended and this one skipped, so a
    resumed run counts a round as the uninterrupted run did.
    """

    rollouts: int
    tokens: int
    mean_reward: float
    tokens_per_s: float
    seconds: float
    store_version: int
    store_wait_s: float = 0.0
    # Prompts too long for the model's context ([generation].prompt_overflow), of the call's.
    prompts_truncated: int = 0
    prompts_skipped: int = 0

    def line(self) -> str:
        """One human-readable closing line."""
        return (
            f"generated {self.rollouts} rollouts, {self.tokens} tokens, "
            f"mean reward {self.mean_reward:.4f}, {self.tokens_per_s:.1f} tokens/s "
            f"({self.seconds:.1f} s, store version {self.store_version})"
            + (f"; {self.prompts_truncated} prompts cut to fit" if self.prompts_truncated else "")
            + (
                f"; {self.prompts_skipped} prompts too long, skipped"
                if self.prompts_skipped
                else ""
            )
        )


def make_generator(
    model: str | Path,
    backend: str,
    *,
    policy_version: int,
    policy_id: str | None = None,
    seed: int = 0,
    generation: GenerationConfig | None = None,
) -> Any:
    """Build the ``backend`` generator ("vllm" or "hf") for the checkpoint folder ``model``;
    ``generation`` (a GenerationConfig) sets the dtype and the vLLM engine options."""
    opts = {} if generation is None else generation.engine_options()
    if backend == "hf":
        from trainer.rollout.hf import HFGenerator

        return HFGenerator(
            model, policy_version=policy_version, policy_id=policy_id,
            dtype=opts.get("dtype", "auto"),
        )  # fmt: skip
    if backend == "vllm":
        from trainer.rollout.vllm import VLLMGenerator

        return VLLMGenerator(
            model, policy_version=policy_version, policy_id=policy_id, seed=seed, **opts
        )
    raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")


# Long: the docstring documents every argument; the body is one loop over the batches.
def generate_rollouts(
    store: Any,
    generator: str | os.PathLike | Generator,
    task: str | Task,
    prompts: int | Sequence[Prompt],
    *,
    generation: GenerationConfig,
    policy_version: int,
    ids: RoundIds = RoundIds(),
    embedder: Any | None = None,
    progress: bool = True,
    on_append: Callable[[int], None] | None = None,
) -> GenerateSummary:
    """Generate ``prompts x generation.group_size`` scored rollouts into ``store``; see the
    module docstring.

    ``generator`` is a checkpoint folder (the ``generation.backend`` generator is built, with
    its dtype and vLLM engine options, and closed again here) or an already-built generator,
    which is used as is (its ``policy_version`` must equal ``policy_version``). ``task`` is a
    task name or :class:`Task`; ``prompts`` a count (drawn with ``task.make_prompts(prompts,
    ids.seed)``) or explicit :class:`Prompt` objects, as the task made them: they are rendered
    here (``task.chat_template``, with the generator's tokenizer; trainer/tasks/chat.py), and
    the rendered text is what the store records. ``generation`` gives the sampling settings,
    ``batch_prompts`` (batch ``b`` is sampled with seed ``ids.seed + b`` and appended as one
    atomic commit), ``advantage_ddof`` (:func:`trainer.algo.advantage.group_advantages`) and,
    for a task with tools (``[task].tools``), ``max_turns`` / ``max_total_tokens``
    (trainer/rollout/multiturn.py). ``ids``: the round's run, policy, seed and id namespace
    (:class:`RoundIds`). ``embedder`` defaults to ``HashingEmbedder(dim=store.embedding_dim)``;
    it must map a list of token-id lists to a ``(N, store.embedding_dim)`` array.
    ``on_append(b)`` is called after batch ``b`` is committed.
    """
    from tqdm.auto import tqdm

    if not isinstance(generation, GenerationConfig):
        raise TypeError(f"generation must be a GenerationConfig, got {type(generation).__name__}")
    if _not_int(policy_version) or policy_version < 0:
        raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
    g, sampling = generation, generation.sampling(seed=ids.seed)
    task_obj = get_task(task) if isinstance(task, str) else task
    prompt_objs = _resolve_prompts(task_obj, prompts, ids.seed)
    if embedder is None:
        embedder = HashingEmbedder(dim=store.embedding_dim)

    gen, owned, prompt_objs = _open_generator(
        generator, task_obj, prompt_objs, g, policy_version, ids
    )
    try:
        # Before anything is sampled, one rule for both backends: prompts that do not fit
        # the model's context beside max_tokens are refused, cut or left out.
        fitted = fit_prompts(
            getattr(gen, "tokenizer", None), prompt_objs, max_tokens=g.max_tokens,
            limit=getattr(gen, "max_model_len", None), policy=g.prompt_overflow,
        )  # fmt: skip
        prompt_objs = fitted.prompts
        bar = tqdm(
            total=len(prompt_objs) * g.group_size,
            unit="rollout",
            desc=f"generate[{resolve_backend(g.backend) if owned else type(gen).__name__}]",
            disable=not progress,
        )
        with bar, _Writer(store, bar, on_append) as writer:
            for b, lo in enumerate(range(0, len(prompt_objs), g.batch_prompts)):
                batch = prompt_objs[lo : lo + g.batch_prompts]
                rollout_ids = ids.rollout_ids(b, len(batch) * g.group_size)
                if _already_stored(store, rollout_ids, writer, bar):
                    continue
                batch_sampling = replace(sampling, seed=ids.seed + b)
                samples = _sample_batch(gen, task_obj, batch, batch_sampling, g)
                rows = _build_rows(
                    gen, task_obj, batch, samples, batch_sampling, rollout_ids,
                    ids.group_ids(b, len(batch)), embedder, store.embedding_dim, ids.run_id,
                    g.advantage_ddof,
                )  # fmt: skip
                writer.submit(b, rows)
        seconds = time.perf_counter() - writer.start
    finally:
        # Stopping an engine takes seconds; it is not part of the measured time.
        if owned and hasattr(gen, "close"):
            gen.close()
    return replace(
        writer.summary(seconds),
        prompts_truncated=len(fitted.truncated),
        prompts_skipped=len(fitted.skipped),
    )


def _open_generator(
    generator: Any,
    task: Task,
    prompts: list[Prompt],
    generation: GenerationConfig,
    policy_version: int,
    ids: RoundIds,
) -> tuple[Any, bool, list[Prompt]]:
    """(generator, whether this call built it, ``prompts`` rendered for its tokenizer)."""
    owned = isinstance(generator, str | os.PathLike)
    gen = (
        make_generator(
            generator,
            resolve_backend(generation.backend),
            policy_version=policy_version,
            policy_id=ids.policy_id,
            seed=ids.seed,
            generation=generation,
        )
        if owned
        else generator
    )
    # The text the model sees (chat-rendered when the task's template mode says so): it is
    # what the generator tokenizes, what the store records and what the reward is given.
    prompts = render_prompts(
        getattr(gen, "tokenizer", None), prompts, getattr(task, "chat_template", "auto")
    )
    recorded = getattr(gen, "policy_version", policy_version)
    if recorded != policy_version:
        raise ValueError(
            f"policy_version {policy_version} does not match the generator's policy_version "
            f"{recorded}; the store would record the wrong policy"
        )
    return gen, owned, prompts


def _already_stored(store: Any, rollout_ids: list[str] | None, writer: _Writer, bar: Any) -> bool:
    """True when an earlier (crashed) attempt appended this batch (batches are atomic); it
    then counts as generated (totals, round reward) as it did then."""
    if rollout_ids is None or not store.count(filter=f"rollout_id = '{rollout_ids[0]}'"):
        return False
    writer.count(_stored_rows(store, rollout_ids))
    bar.update(len(rollout_ids))
    return True


def _sample_batch(
    gen: Any,
    task: Task,
    batch: Sequence[Prompt],
    sampling: SamplingParams,
    generation: GenerationConfig,
) -> list[Sample]:
    """``group_size`` sampled trajectories per prompt of ``batch``, prompt-major (one model
    turn, or several with the task's tools: trainer/rollout/multiturn.py)."""
    samples = samples_for_task(
        gen, task, [p.prompt_text for p in batch], max_turns=generation.max_turns,
        max_total_tokens=generation.max_total_tokens, **sampling.kwargs(),
    )  # fmt: skip
    per = sampling.group_size
    if len(samples) != len(batch) * per:
        raise RuntimeError(
            f"generator returned {len(samples)} samples for {len(batch)} prompts x group {per}"
        )
    for k, sample in enumerate(samples):
        if sample.prompt_index != k // per:
            raise ValueError(
                f"sample {k} is of prompt {sample.prompt_index}, expected {k // per}: samples "
                "must be prompt-major"
            )
    return samples


def _resolve_prompts(task: Task, prompts: int | Sequence[Prompt], seed: int) -> list[Prompt]:
    if isinstance(prompts, int) and not isinstance(prompts, bool):
        if prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {prompts}")
        return task.make_prompts(prompts, seed)
    prompt_objs = list(prompts)
    if not prompt_objs or not all(isinstance(p, Prompt) for p in prompt_objs):
        raise ValueError("prompts must be a count >= 1 or a non-empty list of Prompt")
    return prompt_objs


class _Writer:
    """Appends batch b on a writer thread while batch b+1 generates (one append in flight,
    in order), so the store write costs generation almost no time; keeps the totals."""

    def __init__(self, store: Any, bar: Any, on_append: Any | None):
        self.store, self.bar, self.on_append = store, bar, on_append
        self.version = store.version
        self.rollouts = self.tokens = 0
        self.reward_sum = self.waited = 0.0
        self.start = time.perf_counter()
        self.pending = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-append")

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:
            if exc_type is None:
                self._finish()
        finally:
            self.pool.shutdown(wait=True)

    def submit(self, b: int, rows: list[dict[str, Any]]) -> None:
        self._finish()
        self.pending = (b, self.pool.submit(self.store.append, rows), rows)

    def summary(self, seconds: float) -> GenerateSummary:
        return GenerateSummary(
            rollouts=self.rollouts,
            tokens=self.tokens,
            mean_reward=self.reward_sum / self.rollouts if self.rollouts else float("nan"),
            tokens_per_s=self.tokens / seconds if seconds > 0 else float("inf"),
            seconds=seconds,
            store_version=self.version,
            store_wait_s=self.waited,
        )

    def count(self, rows: list[dict[str, Any]]) -> None:
        # Rewards as the store holds them (float32), so that a batch counted again from the
        # store after a crash adds exactly what it added when generated.
        # Generated tokens are the policy's (loss-mask 1): tool / environment tokens of a
        # multi-turn trajectory were not sampled, so they cost no generation.
        self.rollouts += len(rows)
        self.tokens += sum(_model_tokens(r) for r in rows)
        self.reward_sum += sum(float(np.float32(r["reward"])) for r in rows)

    def _finish(self) -> None:
        if self.pending is None:
            return
        b, fut, rows = self.pending
        self.pending = None
        t0 = time.perf_counter()
        self.version = fut.result().version
        self.waited += time.perf_counter() - t0
        if self.on_append is not None:
            self.on_append(b)
        self.count(rows)
        elapsed = time.perf_counter() - self.start
        self.bar.update(len(rows))
        self.bar.set_postfix(
            reward=f"{self.reward_sum / self.rollouts:.3f}",
            tok_s=f"{self.tokens / max(elapsed, 1e-9):.0f}",
        )


def _stored_rows(store: Any, ids: list[str]) -> list[dict[str, Any]]:
    """Rollouts ``ids`` as stored (completion ids, loss mask, reward), in the order of
    ``ids``; the raw table's null loss mask (all ones, or a v1 store) counts every token."""
    quoted = ", ".join(f"'{i}'" for i in ids)  # our own UUIDs: no quotes inside
    ds = store.dataset()
    columns = ["rollout_id", "completion_ids", "reward"]
    columns += ["loss_mask"] if "loss_mask" in ds.schema.names else []
    t = ds.to_table(columns=columns, filter=f"rollout_id IN ({quoted})")
    rows = {r["rollout_id"]: r for r in t.to_pylist()}
    return [rows[i] for i in ids]


def _build_rows(
    gen: Any,
    task: Task,
    prompts: Sequence[Prompt],
    samples: list[Sample],
    sampling: SamplingParams,
    rollout_ids: list[str] | None,
    group_ids: list[str],
    embedder: Any,
    dim: int,
    run_id: str,
    ddof: int,
) -> list[dict[str, Any]]:
    """One batch's store rows, each built once: its ids (fixed before), what was sampled, the
    reward, the group advantage, the embedding and the bookkeeping columns."""
    rewards = [
        score_completion(task, prompts[s.prompt_index], s.completion_text or "") for s in samples
    ]
    groups = [group_ids[s.prompt_index] for s in samples]
    adv = group_advantages([float(r.reward) for r in rewards], groups, ddof=ddof)
    emb = np.asarray(embedder.embed([s.completion_ids for s in samples]), dtype=np.float32)
    if emb.shape != (len(samples), dim):
        raise ValueError(f"embedder returned shape {emb.shape}, expected {(len(samples), dim)}")
    name = task.name or type(task).__name__
    rows = []
    for k, (sample, result) in enumerate(zip(samples, rewards)):
        prompt = prompts[sample.prompt_index]
        row = {} if rollout_ids is None else {"rollout_id": rollout_ids[k]}
        row["group_id"] = groups[k]
        row.update(sample_columns(gen, prompt.prompt_text, sample, sampling))
        row.update(
            reward=float(result.reward),
            reward_info=json.dumps(result.info, sort_keys=True, default=str),
            advantage=float(adv[k]),
            embedding=emb[k].tolist(),
            task=name,
            run_id=run_id,
            metadata=_metadata(task, prompt),
        )
        rows.append(row)
    return rows


def _metadata(task: Task, prompt: Prompt) -> str:
    meta = {"answer": prompt.answer, "prompt_meta": prompt.meta}
    if prompt.messages is not None:
        # The chat turns the prompt was rendered from: `export --as messages|sft` writes
        # them (not the template's text) as the conversation's prompt.
        meta["messages"] = [dict(m) for m in prompt.messages]
    if getattr(task, "reward_spec", None) is not None:
        meta["reward"] = task.reward_spec  # which reward (and revision) scored the row
    return json.dumps(meta, sort_keys=True, default=str)


def resolve_backend(name: str) -> str:
    """``auto`` is vLLM when it is installed, else transformers."""
    if name != "auto":
        return name
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def _model_tokens(row: dict[str, Any]) -> int:
    mask = row.get("loss_mask")
    return len(row["completion_ids"]) if mask is None else int(sum(mask))
