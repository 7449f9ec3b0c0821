"""Exceptions. One root, ``RolloutStoreError``; each subclass also inherits a builtin."""

from __future__ import annotations


class RolloutStoreError(Exception):
    """Root of every error rolloutstore raises on purpose."""


class SchemaError(RolloutStoreError, ValueError):
    """Data or a store does not match the rollout schema."""


class ValidationError(SchemaError):
    """A row of an append breaks the schema or an invariant. Nothing of the batch was written."""

    def __init__(self, message: str, *, row: int | None = None, field: str | None = None):
        where = []
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message.rstrip(".") + ". Nothing of this batch was written.")
        self.row = row
        self.field = field
        self.reason = message


class IngestError(ValidationError):
    """A row of an ingested file is bad: names ``file:line`` (or Parquet row) and the field."""

    def __init__(self, path: str, where: str, exc: ValidationError):
        field = f", field {exc.field!r}" if exc.field else ""
        reason = exc.reason.rstrip(".")
        Exception.__init__(
            self, f"{path}:{where}{field}: {reason}. Nothing of this file was written."
        )
        self.row, self.field, self.reason, self.path = exc.row, exc.field, exc.reason, path


class SchemaVersionError(SchemaError):
    """The store was written by a newer, unknown schema version."""


class StoreNotFoundError(RolloutStoreError, FileNotFoundError):
    """No store at the given URI and ``create=False``."""


class ReadOnlyError(RolloutStoreError, PermissionError):
    """A write was attempted on a read-only snapshot (``checkout``)."""


class QueryError(RolloutStoreError, ValueError):
    """A SQL query failed or is not allowed."""


class DiskFullError(RolloutStoreError, OSError):
    """The disk filled up during a write; the store is intact at its previous version."""

    def __init__(self, what: str, uri: str):
        super().__init__(
            f"{what} into {uri!r} needs more disk space than is free (no space left on "
            "device); the store is intact at its previous version and nothing of this write "
            "was committed; free disk space (e.g. `rolloutstore gc`, "
            "`rolloutstore compact --cleanup-older-than-hours H`) and retry"
        )


class OutputDiskFullError(DiskFullError):
    """The disk (or device) filled up while an output (``export``, ``sql --out``) was written."""

    def __init__(self, what: str, path: str, in_place: bool):
        kept = (
            "it was written in place (a device or FIFO), so part of it may have gone through"
            if in_place
            else "nothing of it was kept (its temp file was removed) and an older file there "
            "is unchanged"
        )
        super(DiskFullError, self).__init__(
            f"writing the {what} {path!r} needs more space than is free (no space left on "
            f"device); {kept}; free disk space or write it elsewhere, and retry"
        )


class WriteConflictError(RolloutStoreError, OSError):
    """A commit kept losing to concurrent writers (after bounded retries); nothing of it was
    committed."""

    def __init__(self, what: str, uri: str, attempts: int):
        super().__init__(
            f"{what} of {uri!r} lost the commit race to concurrent writers {attempts} times in "
            "a row; nothing of it was committed and the store is intact; run it again (when "
            "fewer writers are active)"
        )


class CorruptStoreError(RolloutStoreError, OSError):
    """The newest version of a store cannot be read (a torn manifest)."""


class FileUnreadableError(IngestError):
    """An input file cannot be read to its end (truncated, corrupt, not the format its
    name says, not a file). Nothing of it was written."""

    def __init__(self, path: str, expected: str, found: str, fix: str):
        Exception.__init__(
            self,
            f"{path}: expected {expected}, found {found}; {fix}. Nothing of this file was written.",
        )
        self.row, self.field, self.reason, self.path = None, None, found, path


class QueryTimeoutError(QueryError, TimeoutError):
    """A query ran past its time limit and was interrupted."""


class QueryInterrupted(QueryError):
    """A query was interrupted from outside (Ctrl-C) rather than by its time limit."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while a command ran (``kill``, a scheduler's stop): raised in the main
    thread as Ctrl-C is, so the same cleanup runs (engines and actor processes stopped,
    temporary files removed) instead of the process dying with its children left behind."""


class UsageError(RolloutStoreError, ValueError):
    """A command-line argument is malformed or names something that does not exist."""


class OutputPathError(RolloutStoreError, ValueError):
    """An output path would overwrite part of a store (or is otherwise unusable)."""


# Errors that used to live beside the code raising them (re-exported there).
class ExportError(RolloutStoreError, ValueError):
    """An export was asked for with options that do not fit together, or could not be written."""


class EmptyExportError(ExportError):
    """An export would hold no row (its message says why); nothing was written."""


class MissingDependencyError(RolloutStoreError, ImportError):
    """An optional package needed by the asked-for format is not installed."""


class EmptyBufferError(RolloutStoreError, LookupError):
    """No rollout is eligible under the replay config."""


class RewardVersionError(RolloutStoreError, ValueError):
    """``ReplayConfig.reward_version`` names a re-scoring the store does not have."""


class RescoreError(RolloutStoreError, ValueError):
    """A re-scoring was refused (unknown task, bad filter, a row without its answer)."""


class ShortBatchWarning(UserWarning):
    """A drawn batch holds fewer rows than asked (``per_prompt_cap``, a small buffer)."""


class ShrunkBatchWarning(UserWarning):
    """A token budget (``max_tokens``, a run's ``max_tokens_per_batch``) held fewer rows than
    the ``batch_size`` drawn; ``Selection.budget_cut`` counts the rows it cut each step."""


class RowOverBudgetWarning(UserWarning):
    """Eligible rows longer than the token budget were left out of the draw (no batch can hold
    them); ``Selection.over_budget`` counts them each step."""


class RowOverBudgetError(RolloutStoreError, ValueError):
    """Every eligible row is longer than the token budget: no batch can be drawn."""


class ResumeStateError(RolloutStoreError, ValueError):
    """A checkpoint's rolloutstore state is damaged, or belongs to another run or store."""


class MissingEmbeddingWarning(UserWarning):
    """``diversity="embedding"`` met rows without an embedding (imported rows): they were
    drawn with prompt diversity instead; ``Selection.no_embedding`` counts them."""
