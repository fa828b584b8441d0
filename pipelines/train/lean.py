"""Ray Train on a cluster the run started for itself, without what only a shared cluster needs.

Ray Train V2's ``TorchTrainer.fit`` starts, besides its controller and workers, three actors
(each a Python process of its own):

* a placement-group cleaner, which removes the workers' placement group if the controller dies
  while the cluster lives on;
* the autoscaling coordinator, which the controller asks for the workers' resources (and waits
  for) before it starts them, so that an autoscaler can add nodes;
* a dataset manager, which hands out Ray Data shards.

and the controller itself is an actor: a Python process that imports Ray Train before it starts
the workers.

On a one-node cluster that the run started and stops at its end, none of them has work: the
cluster's shutdown removes every placement group, it has no autoscaler, and the platform reads
its own shards (no Ray Data). On 2 cores the three processes cost about 1.7 s of the time from
launch to the first step, and the controller's process about 4 s more (measured:
docs/fashion-mnist.md, start-up). :class:`LeanTorchTrainer` leaves the three out and runs the
controller's loop in the driver, which has Ray Train imported already (``DP_TRAIN_CONTROLLER_ACTOR=1``
keeps Ray's controller actor instead); on a cluster that was joined the driver uses the plain
``TorchTrainer``.

This module is imported by Ray Train's controller (it unpickles the scaling policy), so it
imports Ray Train only, not torch's training stack or the platform's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from ray.runtime_context import RuntimeContext
from ray.train.torch import TorchTrainer

CONTROLLER_ACTOR_ENV = "DP_TRAIN_CONTROLLER_ACTOR"

try:  # Ray Train V2's internals (ray 2.5x-2.6x); without them, the plain trainer is used
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.constants import ENABLE_CONTROLLER_STRUCTURED_LOGGING_ENV_VAR
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
except ImportError:  # pragma: no cover - another Ray version
    FixedScalingPolicy = None


if FixedScalingPolicy is not None and hasattr(TorchTrainer, "_create_default_callbacks"):

    class FixedNodeScalingPolicy(FixedScalingPolicy):
        """Ray Train's fixed-size policy, minus its requests to the autoscaling coordinator."""

        def after_controller_start(self, train_run_context) -> None:
            pass

        def _maybe_send_resource_request(self) -> None:
            pass

    class LeanTorchTrainer(TorchTrainer):
        """``TorchTrainer`` without the placement-group cleaner, the autoscaling coordinator
        and (when no Ray Datasets are given) the dataset manager. Only for a cluster the run
        started itself and stops at its end."""

        def _create_default_callbacks(self):
            drop = (PlacementGroupCleanerCallback,) + (() if self.datasets else (DatasetsCallback,))
            return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, drop)]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            if not getattr(self.scaling_config, "elasticity_enabled", False):
                controller_init_kwargs["scaling_policy"] = FixedNodeScalingPolicy(self.scaling_config)
            # Ray's own controller actor: on request, or under a running event loop (a notebook's),
            # in which asyncio.run cannot nest
            if os.environ.get(CONTROLLER_ACTOR_ENV) == "1" or _event_loop_running():
                return super()._initialize_and_run_controller(**controller_init_kwargs)
            return run_controller_here(**controller_init_kwargs)

    def run_controller_here(**controller_init_kwargs):
        """Ray Train's controller loop in this process (the driver's), not in an actor of its own:
        the same ``TrainController``, with the same worker group, polling, failure policy (a
        worker that dies is replaced from the last checkpoint) and result. Its log records go to
        the ``ray.train`` logger, i.e. to the driver's log file, not to Ray Train's JSON logs.
        The workers get no handle of a controller actor, so ``ray.train.get_all_reported_checkpoints``
        is not available to them (the platform's workers do not call it). An interrupt stops the
        loop; the cluster's shutdown, which follows, ends the workers."""
        os.environ.setdefault(ENABLE_CONTROLLER_STRUCTURED_LOGGING_ENV_VAR, "0")
        with _current_actor_is_none_in_the_driver():
            controller = TrainController(**controller_init_kwargs)
            asyncio.run(controller.run())
        return controller.get_result()  # fit() raises its error, as after Ray's actor

    @contextlib.contextmanager
    def _current_actor_is_none_in_the_driver():
        """Ray Train hands each worker ``ray.get_runtime_context().current_actor`` of the process
        that starts the worker group, which raises outside an actor. Inside this block it is
        None in a process that is no actor (unchanged in actors)."""
        prop = RuntimeContext.current_actor

        def current_actor(self):
            return None if self.worker.actor_id.is_nil() else prop.fget(self)

        RuntimeContext.current_actor = property(current_actor, doc=prop.__doc__)
        try:
            yield
        finally:
            RuntimeContext.current_actor = prop

    def _event_loop_running() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

else:  # pragma: no cover - another Ray version
    LeanTorchTrainer = TorchTrainer
