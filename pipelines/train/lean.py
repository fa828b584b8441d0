"""Ray Train on a cluster the run started for itself, without what only a shared cluster needs.

Ray Train V2's ``TorchTrainer.fit`` starts, besides its controller and workers, three actors
(each a Python process of its own):

* a placement-group cleaner, which removes the workers' placement group if the controller dies
  while the cluster lives on;
* the autoscaling coordinator, which the controller asks for the workers' resources (and waits
  for) before it starts them, so that an autoscaler can add nodes;
* a dataset manager, which hands out Ray Data shards.

On a one-node cluster that the run started and stops at its end, none of them has work: the
cluster's shutdown removes every placement group, it has no autoscaler, and the platform reads
its own shards (no Ray Data). On 2 cores the three processes cost about 1.7 s of the time from
launch to the first step (measured: docs/fashion-mnist.md, start-up). :class:`LeanTorchTrainer`
leaves them out; on a cluster that was joined the driver uses the plain ``TorchTrainer``.

This module is imported by Ray Train's controller (it unpickles the scaling policy), so it
imports Ray Train only, not torch's training stack or the platform's.
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer

try:  # Ray Train V2's internals (ray 2.5x-2.6x); without them, the plain trainer is used
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
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
            return super()._initialize_and_run_controller(**controller_init_kwargs)

else:  # pragma: no cover - another Ray version
    LeanTorchTrainer = TorchTrainer
