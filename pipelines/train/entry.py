"""The function Ray Train ships to its controller and workers: a thin entry point.

Ray pickles the training function by reference, so every process that unpickles it (the
TrainController as well as each worker) imports its module. This module imports nothing
heavy, so the controller starts without importing torch, dpcore or MLflow; the workers
import :mod:`pipelines.train.worker` when they run it.
"""


def train_loop_per_worker(config: dict) -> None:
    """``config`` = {"plan": the run's :class:`pipelines.plan.RunPlan`, "pruner": a callable or None,
    "faults": a test's :class:`pipelines.faults.FaultInjection` or None, "plds": the PLDs the
    driver built for the run's events (:func:`pipelines.train.run_ledger.plds_for_workers`)}."""
    from dpcore.accountants.pld import import_base_plds

    from .run_ledger import unlock_journal
    from .worker import train_loop_per_worker as run

    import_base_plds(config.get("plds", ()))
    plan = config["plan"]
    try:
        run(plan, config.get("pruner"), config.get("faults"))
    finally:
        if plan.config.get("in_process"):  # this process goes on as the driver: let go of the run's journal
            unlock_journal()
