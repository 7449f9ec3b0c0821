"""Exceptions of the trainer. One root, ``TrainerError``; each subclass also inherits a builtin.

The CLIs print these as one line (no traceback); anything else is a bug.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Root of every error the trainer raises on purpose."""


class ConfigError(TrainerError, ValueError):
    """A config file names an unknown key or a bad value; names ``[section].key``."""


class RunDirError(TrainerError, ValueError):
    """The run folder does not fit the request (exists already, or holds nothing to resume)."""


class SourceError(TrainerError, ValueError):
    """An earlier run cannot be reused here (missing, or another tokenizer)."""


class WeightUpdateError(TrainerError, RuntimeError):
    """An in-place update failed, or vLLM's outputs do not match the weights it was sent."""


class UnsafeExpressionError(TrainerError, ValueError):
    """The text is not an expression built only from the whitelisted arithmetic."""


class ModelError(TrainerError, FileNotFoundError):
    """A model folder is missing or is not a model folder (no config.json)."""


class CheckpointError(TrainerError, ValueError):
    """A checkpoint folder is damaged (or none of a run's is usable); names the folder."""


class BufferExhaustedError(TrainerError, LookupError):
    """The replay buffer had no eligible row for a learner step (e.g. every row used
    ``max_uses`` times): the run stops; its checkpoints stay resumable."""

    def __init__(self, step: int, run_dir, cause: BaseException):
        super().__init__(
            f"learner step {step}: the replay buffer has no eligible rows ({cause}); the run "
            f"stopped and resumes from its newest checkpoint: relax [replay] (max_uses, window, "
            f"max_staleness, where) or generate more per round ([generation].prompts_per_round), "
            f"e.g. `rolloutstore-train resume {run_dir} --set replay.max_uses=8`"
        )


class TaskError(TrainerError, ValueError):
    """A task cannot be built or used: a bad field mapping, an unknown reward, a prompt its
    tokenizer cannot render; names the file, row or setting and the fix."""


class TaskFileError(TrainerError, FileNotFoundError):
    """A task's prompt file (or dataset folder) does not exist."""


class BehaviorPolicyError(TrainerError, ValueError):
    """Replayed rows whose behaviour log-probs the learner cannot reproduce (e.g. recorded with
    ``logprobs_mode = "raw_logprobs"``, before the sampler's processing); names the rows and
    their sampling settings."""
