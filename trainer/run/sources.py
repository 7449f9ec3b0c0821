"""Reuse rollouts of earlier runs: import them into a run's store with a defined staleness.

    [run]
    sources = ["runs/arith-a"]        # earlier run folders (or store folders)

Each earlier run's rollouts are copied (streamed, one atomic append per run) with
their ids, run_id and behaviour log-probs, so the importance correction stays
valid. Their ``policy_version`` is rebased so that the source run's newest
version sits just before this run's version 0 (``v - newest - 1``), and the
lineage table records ``(this run, 0, source run, newest)``: a source rollout's
staleness at learner version ``u`` is then ``u + newest + 1 - v``. Rollouts are
reused only across tokenizers with the same fingerprint; anything else is an
error, since token ids would mean different text. Likewise a run with rows whose
behaviour log-probs the learner cannot reproduce (``logprobs_mode`` not processed,
temperature <= 0, ...) is refused before anything is copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from rolloutstore import RolloutStore
from trainer.algo.behavior import check_logprobs_modes
from trainer.errors import SourceError


def _open_source(path: str | Path) -> RolloutStore:
    path = Path(path)
    root = path / "store" if (path / "store" / "rollouts.lance").exists() else path
    if not (root / "rollouts.lance").exists():
        raise SourceError(f"replay source {path}: no rollout store there (nor in {path}/store)")
    return RolloutStore.open(root, create=False)


def _rebased(src: RolloutStore, run_id: str, shift: int) -> Iterator[pa.Table]:
    scanner = src.dataset().scanner(
        filter=f"run_id = '{run_id.replace(chr(39), chr(39) * 2)}'", batch_size=4096
    )
    for batch in scanner.to_batches():
        t = pa.Table.from_batches([batch])
        i = t.schema.get_field_index("policy_version")
        yield t.set_column(i, "policy_version", pc.subtract(t["policy_version"], shift))


def _check_sampling(src: RolloutStore, source: str | Path, run_id: str) -> None:
    """Refuse a run whose behaviour log-probs the learner could not reproduce (one row per
    distinct setting, named in the error)."""
    settings = src.sql(
        "SELECT min(rollout_id) AS rollout_id, logprobs_mode, temperature, top_k, top_p "
        "FROM rollouts WHERE run_id = ? GROUP BY 2, 3, 4, 5",
        [run_id],
    ).to_pylist()
    check_logprobs_modes(settings, f"replay source {source} run {run_id!r}")


def import_sources(
    store: RolloutStore, sources: list[str] | tuple[str, ...], *, run_id: str, fingerprint: str
) -> list[dict]:
    """Copy every run of each source into ``store``; returns one summary per imported run."""
    done = set(store.sql("SELECT DISTINCT run_id FROM rollouts")["run_id"].to_pylist())
    summaries = []
    for source in sources:
        src = _open_source(source)
        if src.embedding_dim != store.embedding_dim:
            raise SourceError(
                f"replay source {source} stores {src.embedding_dim}-dimensional embeddings, this "
                f"run's store {store.embedding_dim}: rollouts are reused only between stores "
                f"with the same embedding dimension (the run's embedder decides it)"
            )
        runs = src.sql(
            "SELECT run_id, max(policy_version) AS newest, count(*) AS n, "
            "list(DISTINCT tokenizer_fingerprint) AS fps FROM rollouts GROUP BY 1 ORDER BY 1"
        ).to_pylist()
        for r in runs:
            fps = {f for f in r["fps"] if f is not None}
            if fps != {fingerprint}:
                raise SourceError(
                    f"replay source {source} run {r['run_id']!r} was generated with tokenizer "
                    f"fingerprint(s) {sorted(fps) or ['unknown']}, this run's tokenizer is "
                    f"{fingerprint!r}; rollouts are reused only with the same tokenizer"
                )
            if r["run_id"] == run_id:
                raise SourceError(f"replay source {source} holds this run's own id {run_id!r}")
            if r["run_id"] in done:  # imported before (e.g. by the run this one resumes)
                continue
            _check_sampling(src, source, r["run_id"])
            shift = r["newest"] + 1
            store.append(_rebased(src, r["run_id"], shift))
            store.record_lineage(run_id, 0, r["run_id"], r["newest"])
            summaries.append(
                {
                    "source": str(source),
                    "run_id": r["run_id"],
                    "rollouts": r["n"],
                    "parent_version": r["newest"],
                }
            )
    return summaries
