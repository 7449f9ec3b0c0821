"""The generate pipeline: task prompts -> sampled groups -> rewards, advantages, embeddings -> store.

:func:`generate_rollouts` draws ``prompts`` prompts from a task, samples ``group_size``
completions per prompt with the vLLM or transformers backend, scores each completion with the
task's verifiable reward, computes GRPO group advantages, embeds the completion token ids with
:class:`trainer.rollout.embed.HashingEmbedder` (``dim = store.embedding_dim``) and appends every batch of
prompts to the store as one atomic commit (a batch is either fully in the store or not at all).

Python::

    from rolloutstore import RolloutStore
    from trainer.rollout.pipeline import generate_rollouts

    store = RolloutStore.open("runs/x/store")
    summary = generate_rollouts(store, model="runs/x/tiny-model", task="arith", prompts=256,
                                group_size=8, policy_version=0, backend="hf")
    print(summary.rollouts, summary.mean_reward, summary.tokens_per_s)

CLI (registered on ``rolloutstore`` by :mod:`trainer.store_commands`)::

    rolloutstore-train generate STORE --model DIR|tiny --task arith --prompts 256 --group-size 8 \\
        --policy-version 0 --backend vllm|hf [--temperature T --top-p P --top-k K \\
        --max-tokens N --seed S --run-id ID]

``--model tiny`` builds (once) a tiny random model for the task into ``STORE/../tiny-model``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rolloutstore.schema.ids import deterministic_uuid7
from trainer.algo.advantage import group_advantages
from trainer.rollout.embed import HashingEmbedder
from trainer.rollout.multiturn import generate_for_task
from trainer.rollout.sampling import SamplingParams, _not_int
from trainer.tasks import Prompt, Task, get_task
from trainer.tasks.chat import render_prompts

BACKENDS = ("vllm", "hf")
TINY_MODEL = "tiny"


class Generator(Protocol):
    """What :func:`generate_rollouts` needs from a backend (HFGenerator, VLLMGenerator)."""

    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        temperature: float = ...,
        top_p: float = ...,
        top_k: int = ...,
        max_tokens: int = ...,
        seed: int = ...,
    ) -> list[dict[str, Any]]: ...


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

    def line(self) -> str:
        """One human-readable closing line."""
        return (
            f"generated {self.rollouts} rollouts, {self.tokens} tokens, "
            f"mean reward {self.mean_reward:.4f}, {self.tokens_per_s:.1f} tokens/s "
            f"({self.seconds:.1f} s, store version {self.store_version})"
        )


def make_generator(
    model: str | Path,
    backend: str,
    *,
    policy_version: int,
    policy_id: str | None = None,
    seed: int = 0,
    generation: Any = None,
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


def score_rows(task: Task, prompts: Sequence[Prompt], rows: list[dict[str, Any]]) -> None:
    """Set ``reward`` and ``reward_info`` (JSON) on prompt-major ``rows`` in place.

    ``rows`` holds ``len(rows) // len(prompts)`` completions per prompt, in prompt order; each
    row's ``prompt_text`` must be its prompt's (a mismatch means the backend reordered rows).
    """
    if not prompts or len(rows) % len(prompts):
        raise ValueError(f"{len(rows)} rows do not split into groups over {len(prompts)} prompts")
    per = len(rows) // len(prompts)
    for k, row in enumerate(rows):
        prompt = prompts[k // per]
        if row.get("prompt_text") != prompt.prompt_text:
            raise ValueError(
                f"row {k} has prompt_text {row.get('prompt_text')!r}, expected "
                f"{prompt.prompt_text!r}: rows must be prompt-major"
            )
        result = task.reward(prompt, row["completion_text"] or "")
        row["reward"] = float(result.reward)
        row["reward_info"] = json.dumps(result.info, sort_keys=True, default=str)


# Long: a 30-line docstring documents every argument; the body (~50 lines) is one loop.
def generate_rollouts(
    store: Any,
    *,
    model: str | Path | Generator,
    task: str | Task,
    prompts: int | Sequence[Prompt],
    group_size: int,
    policy_version: int,
    backend: str = "vllm",
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_tokens: int = 64,
    seed: int = 0,
    batch_prompts: int = 64,
    embedder: Any | None = None,
    run_id: str = "default",
    policy_id: str | None = None,
    progress: bool = True,
    id_namespace: str | None = None,
    id_time_ms: int = 0,
    on_append: Any | None = None,
    advantage_ddof: int = 0,
    max_turns: int = 1,
    max_total_tokens: int = 0,
) -> GenerateSummary:
    """Generate ``prompts x group_size`` scored rollouts into ``store``; see the module docstring.

    ``id_namespace``: give rows deterministic ids (and group ids) derived from it, and
    skip batches whose rows are already in the store, so that a resumed run
    regenerates exactly what is missing and nothing twice. ``on_append(b)`` is called
    after batch ``b`` is committed. ``advantage_ddof``: the group std's ddof (0: population,
    the default; 1: sample std, verl / TRL), see :func:`trainer.algo.advantage.group_advantages`.

    ``model`` is a checkpoint folder (the ``backend`` generator is built and, for vLLM, closed
    again here) or an already-built generator, which is used as is (its ``policy_version`` must
    equal ``policy_version``). ``task`` is a task name or :class:`Task`; ``prompts`` a count
    (drawn with ``task.make_prompts(prompts, seed)``) or explicit :class:`Prompt` objects, as
    the task made them: they are rendered here (``task.chat_template``, with the generator's
    tokenizer; trainer/tasks/chat.py), and the rendered text is what the store records.
    Batch ``b`` of ``batch_prompts`` prompts is sampled with seed ``seed + b``. ``embedder``
    defaults to ``HashingEmbedder(dim=store.embedding_dim)``; it must map a list of token-id
    lists to a ``(N, store.embedding_dim)`` array. A task with tools (``[task].tools``) gets
    multi-turn rows, ``max_turns`` / ``max_total_tokens`` (trainer/rollout/multiturn.py).
    """
    from tqdm.auto import tqdm

    sampling = SamplingParams(group_size, temperature, top_p, top_k, max_tokens, seed)
    _check_args(backend, batch_prompts, policy_version, run_id)
    task_obj = get_task(task) if isinstance(task, str) else task
    prompt_objs = _resolve_prompts(task_obj, prompts, seed)
    if embedder is None:
        embedder = HashingEmbedder(dim=store.embedding_dim)

    gen, owned, prompt_objs = _open_generator(
        model, backend, task_obj, prompt_objs, policy_version, policy_id, seed
    )
    try:
        bar = tqdm(
            total=len(prompt_objs) * group_size,
            unit="rollout",
            desc=f"generate[{backend if owned else type(gen).__name__}]",
            disable=not progress,
        )
        with bar, _Writer(store, bar, on_append) as writer:
            for b, lo in enumerate(range(0, len(prompt_objs), batch_prompts)):
                batch = prompt_objs[lo : lo + batch_prompts]
                ids = _BatchIds(id_namespace, b, id_time_ms) if id_namespace is not None else None
                if _already_stored(store, ids, len(batch) * group_size, writer, bar):
                    continue
                rows = _sample_batch(
                    gen, task_obj, batch, replace(sampling, seed=seed + b), max_turns,
                    max_total_tokens,
                )  # fmt: skip
                _finish_rows(
                    rows, batch, task_obj, embedder, store.embedding_dim, run_id, advantage_ddof
                )
                if ids is not None:
                    _set_ids(rows, ids, group_size)
                writer.submit(b, rows)
        seconds = time.perf_counter() - writer.start
    finally:
        # Stopping an engine takes seconds; it is not part of the measured time.
        if owned and hasattr(gen, "close"):
            gen.close()
    return writer.summary(seconds)


def _open_generator(
    model: Any,
    backend: str,
    task: Task,
    prompts: list[Prompt],
    policy_version: int,
    policy_id: str | None,
    seed: int,
) -> tuple[Any, bool, list[Prompt]]:
    """(generator, whether this call built it, ``prompts`` rendered for its tokenizer)."""
    owned = not hasattr(model, "generate")
    gen = (
        make_generator(
            model, backend, policy_version=policy_version, policy_id=policy_id, seed=seed
        )
        if owned
        else model
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


def _set_ids(rows: list[dict[str, Any]], ids: _BatchIds, group_size: int) -> None:
    """The batch's deterministic rollout and group ids (after its advantages are computed)."""
    for k, row in enumerate(rows):
        row["rollout_id"] = ids.rollout(k)
        row["group_id"] = ids.group(k // group_size)


def _check_args(backend: str, batch_prompts: int, policy_version: int, run_id: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if _not_int(batch_prompts) or batch_prompts < 1:
        raise ValueError(f"batch_prompts must be an int >= 1, got {batch_prompts!r}")
    if _not_int(policy_version) or policy_version < 0:
        raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty str, got {run_id!r}")


def _already_stored(store: Any, ids: _BatchIds | None, n: int, writer: _Writer, bar: Any) -> bool:
    """True when an earlier (crashed) attempt appended this batch (batches are atomic); it
    then counts as generated (totals, round reward) as it did then."""
    if ids is None or not store.count(filter=f"rollout_id = '{ids.rollout(0)}'"):
        return False
    writer.count(_stored_rows(store, [ids.rollout(k) for k in range(n)]))
    bar.update(n)
    return True


def _sample_batch(
    gen: Any,
    task: Task,
    batch: Sequence[Prompt],
    sampling: SamplingParams,
    max_turns: int,
    max_total_tokens: int,
) -> list[dict[str, Any]]:
    """``group_size`` sampled trajectories per prompt of ``batch``, prompt-major (one model
    turn, or several with the task's tools: trainer/rollout/multiturn.py)."""
    rows = generate_for_task(
        gen, task, [p.prompt_text for p in batch], max_turns=max_turns,
        max_total_tokens=max_total_tokens, **sampling.kwargs(),
    )  # fmt: skip
    if len(rows) != len(batch) * sampling.group_size:
        raise RuntimeError(
            f"generator returned {len(rows)} rows for {len(batch)} prompts x "
            f"group {sampling.group_size}"
        )
    return rows


def _resolve_prompts(task: Task, prompts: int | Sequence[Prompt], seed: int) -> list[Prompt]:
    if isinstance(prompts, int) and not isinstance(prompts, bool):
        if prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {prompts}")
        return task.make_prompts(prompts, seed)
    prompt_objs = list(prompts)
    if not prompt_objs or not all(isinstance(p, Prompt) for p in prompt_objs):
        raise ValueError("prompts must be a count >= 1 or a non-empty list of Prompt")
    return prompt_objs


@dataclass(frozen=True)
class _BatchIds:
    """Deterministic rollout and group ids of batch ``b`` under ``namespace``."""

    namespace: str
    b: int
    time_ms: int

    def rollout(self, k: int) -> str:
        return deterministic_uuid7(f"{self.namespace}/b{self.b}/{k}", self.time_ms)

    def group(self, g: int) -> str:
        return f"{self.namespace}/b{self.b}/g{g}"


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


def _finish_rows(
    rows: list[dict[str, Any]],
    prompts: Sequence[Prompt],
    task: Task,
    embedder: Any,
    dim: int,
    run_id: str,
    ddof: int = 0,
) -> None:
    """Rewards, advantages, embeddings and bookkeeping columns for one batch, in place."""
    score_rows(task, prompts, rows)
    adv = group_advantages([r["reward"] for r in rows], [r["group_id"] for r in rows], ddof=ddof)
    emb = np.asarray(embedder.embed([r["completion_ids"] for r in rows]), dtype=np.float32)
    if emb.shape != (len(rows), dim):
        raise ValueError(f"embedder returned shape {emb.shape}, expected {(len(rows), dim)}")
    per = len(rows) // len(prompts)
    for k, row in enumerate(rows):
        prompt = prompts[k // per]
        row["advantage"] = float(adv[k])
        row["embedding"] = emb[k].tolist()
        row["task"] = task.name or type(task).__name__
        row["run_id"] = run_id
        meta = {"answer": prompt.answer, "prompt_meta": prompt.meta}
        if prompt.messages is not None:
            # The chat turns the prompt was rendered from: `export --as messages|sft` writes
            # them (not the template's text) as the conversation's prompt.
            meta["messages"] = [dict(m) for m in prompt.messages]
        if getattr(task, "reward_spec", None) is not None:
            meta["reward"] = task.reward_spec  # which reward (and revision) scored the row
        row["metadata"] = json.dumps(meta, sort_keys=True, default=str)


def resolve_backend(name: str) -> str:
    """``auto`` is vLLM when it is installed, else transformers."""
    if name != "auto":
        return name
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def _model_tokens(row: dict[str, Any]) -> int:
    mask = row.get("loss_mask")
    return len(row["completion_ids"]) if mask is None else int(sum(mask))
