"""The Ray launcher (``[run] launcher = "ray"``): the async learner's actors as Ray actors.

    rolloutstore-train train examples/arith.toml --set 'run.mode="async"' \
        --set 'run.launcher="ray"' --set 'run.ray.address="auto"' --actors 4

:class:`RayActorPool` has the interface of :class:`trainer.run.async_learner.ActorPool`
(start_all, check, stop). Each actor is a Ray actor whose one long task calls
:func:`trainer.run.actor.run_actor`, so Ray places it (``[run.ray]``: CPUs, GPUs, custom
resources, a placement group), restarts it when its process or node dies
(``max_restarts``) and runs the task again on the new incarnation
(``max_task_retries=-1``). The learner's driver owns the actors: when the learner stops or
dies, Ray kills them (this replaces the local launcher's parent-pid watchdog).

Nothing that resume needs lives in Ray. An actor reads the run's identity from
``WEIGHTS/run.json`` and its next round from ``WEIGHTS/actors/a{K}.json`` (beside the
weights, which an actor on another node reaches as it reaches the store), and
``generate_rollouts`` skips the batches already stored. After a node loss the old
incarnation may keep writing beside its replacement; the store's keyed insert lands each
rollout id once (:mod:`rolloutstore.store.unique`).

Ray is imported here only, and this module only when the launcher is "ray".
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from trainer.rollout.ray_config import RayConfig
from trainer.run.actor import JOIN_SECONDS
from trainer.run.faults import ACTOR_FAULT_ENV


def import_ray():
    """The ``ray`` module, or an ImportError that names the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            '[run] launcher = "ray" needs Ray: pip install "rolloutstore[ray]" '
            f"(ray and lance-ray); {exc}"
        ) from exc
    return ray


class RolloutActor:
    """One actor of the run (a Ray actor class once wrapped by ``ray.remote``)."""

    def __init__(self, env: dict[str, str]):
        import ray

        # A fault injected for a test kills the first incarnation only (as the local pool
        # drops it from a restarted process's environment).
        if ray.get_runtime_context().was_current_actor_reconstructed:
            env = {k: v for k, v in env.items() if k != ACTOR_FAULT_ENV}
            os.environ.pop(ACTOR_FAULT_ENV, None)
        os.environ.update(env)

    def run(self, run_dir: str, cfg: Any, actor_id: int, kwargs: dict[str, Any]) -> int:
        """``run_actor`` from the run folder where this node sees it (one machine, a shared
        filesystem), else as a standalone actor from the run's config: the run's identity
        then comes from WEIGHTS/run.json."""
        from trainer.run.actor import run_actor

        source = run_dir if (Path(run_dir) / "run.json").is_file() else cfg
        return run_actor(source, actor_id, state_beside_weights=True, **kwargs)

    def where(self) -> str:
        """The Ray node id this incarnation runs on (tests remove that node)."""
        import ray

        return ray.get_runtime_context().get_node_id()


class RayActorPool:
    """The learner's actors on a Ray cluster: start, check (report restarts), stop."""

    def __init__(
        self,
        run_dir: Path,
        n: int,
        ahead: int,
        metrics: Any,
        *,
        ray_cfg: RayConfig,
        weights_dir: str | Path,
        store_uri: str,
        options: dict[str, str] | None,
        train_cfg: Any,
    ):
        self.train_cfg = train_cfg
        self.run_dir, self.n, self.ahead, self.metrics = run_dir, n, ahead, metrics
        self.cfg, self.weights_dir, self.store_uri = ray_cfg, weights_dir, store_uri
        self.options = options
        self.ray = ray = import_ray()
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(**_init_args(ray_cfg))
        self.actors: dict[int, Any] = {}
        self.tasks: dict[int, Any] = {}
        self.restarts = dict.fromkeys(range(n), 0)
        self.group = None
        (run_dir / "actors").mkdir(exist_ok=True)

    def start_all(self) -> None:
        ray, c = self.ray, self.cfg
        if c.placement:
            bundle = {"CPU": c.num_cpus, "GPU": c.num_gpus, **c.resources}
            bundle = {k: v for k, v in bundle.items() if v}
            self.group = ray.util.placement_group([bundle] * self.n, strategy=c.placement)
            ray.get(self.group.ready())
        env = {k: os.environ[k] for k in (ACTOR_FAULT_ENV,) if k in os.environ}
        for k in range(self.n):
            self.actors[k] = self._new_actor(k, env)
            self._submit(k)

    def _new_actor(self, k: int, env: dict[str, str]) -> Any:
        """The Ray actor of slot ``k``: [run.ray]'s resources and restarts, in bundle ``k`` of
        the placement group if there is one."""
        c = self.cfg
        options: dict[str, Any] = {
            "num_cpus": c.num_cpus, "num_gpus": c.num_gpus, "resources": dict(c.resources),
            "max_restarts": c.max_restarts, "max_task_retries": -1,
        }  # fmt: skip
        if self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=k
            )
        return self.ray.remote(RolloutActor).options(**options).remote(env)

    def _submit(self, k: int) -> None:
        kwargs = {
            "rounds_ahead": self.ahead, "weights_dir": str(self.weights_dir),
            "store_uri": self.store_uri, "storage_options": self.options,
        }  # fmt: skip
        self.tasks[k] = self.actors[k].run.remote(str(self.run_dir), self.train_cfg, k, kwargs)

    def check(self, step: int, write) -> None:
        """Resubmit an actor's task that ended with an error (Ray itself restarts actors
        whose process or node died, up to max_restarts: those show in the actor's log)."""
        ray = self.ray
        done, _ = ray.wait(list(self.tasks.values()), num_returns=len(self.tasks), timeout=0)
        for k, ref in list(self.tasks.items()):
            if ref not in done:
                continue
            died = False
            try:
                ray.get(ref)
                error = "returned before STOP"
            except Exception as exc:  # RayTaskError, RayActorError: the actor's failure
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                died = isinstance(exc, ray.exceptions.RayActorError)  # restarts used up
            self.restarts[k] += 1
            write(f"actor {k} failed ({error}); restarting its task ({self.restarts[k]} time(s))")
            self.metrics.log(
                "actor_restart", step, {"actor": k, "error": error, "restarts": self.restarts[k]}
            )
            if self.restarts[k] > self.cfg.max_restarts:
                raise RuntimeError(f"actor {k} failed {self.restarts[k]} times: {error}")
            if died:  # a new actor for the slot (the fault injected for tests not passed on)
                time.sleep(1.0)  # let Ray release the dead actor's resources
                self.actors[k] = self._new_actor(k, {})
            self._submit(k)

    def stop(self) -> None:
        """Write STOP, let the actors finish their round, then kill them (and the local
        cluster this pool started)."""
        ray = self.ray
        (self.run_dir / "STOP").touch()
        try:
            ray.wait(list(self.tasks.values()), num_returns=len(self.tasks), timeout=JOIN_SECONDS)
        finally:
            for actor in self.actors.values():
                ray.kill(actor, no_restart=True)
            if self.group is not None:
                ray.util.remove_placement_group(self.group)
            if self.started_ray:
                ray.shutdown()


def _init_args(c: RayConfig) -> dict[str, Any]:
    """ray.init's arguments: join ``address``, or start a local cluster (no dashboard)."""
    if c.address:
        return {"address": c.address}
    args: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if c.local_cpus:
        args["num_cpus"] = c.local_cpus
    return args
