"""The federated run, round by round: plan, sample clients, run them on the pool, release each
round once (:mod:`dpcore.federated`), evaluate, track (see the package's docstring)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import dpcore
from dpcore.federated import AdaptiveClipping, ClientLevelDP, nonprivate_median_clip_norm
from dpcore.readout import epsilon_text

from .. import tracking
from ..data import public_example
from ..models import build_model
from .clients import load_flat
from .config import BYTES_PER_FLOAT, ActorFault, FederatedConfig
from .plan import no_guarantee, plan_federated, run_tags
from .pools import LocalPool, RayPool


def _evaluate(model, split) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(split.x)
        loss = float(torch.nn.functional.cross_entropy(logits, split.y))
        acc = float((logits.argmax(1) == split.y).float().mean())
    return acc, loss


def run_federated(cfg: FederatedConfig | None = None, faults: ActorFault | None = None) -> dict:
    """Plan, run the rounds, log to MLflow. Returns a summary (run id, ε, δ, accuracy, rounds,
    communication, restarts, seconds). Realised per-round counts are in the summary (the
    server sees them) but go to MLflow only in diagnostics mode. ``faults`` (tests only) kills
    one actor once."""
    import mlflow
    from mlflow import MlflowClient

    cfg = cfg or FederatedConfig()
    if faults is not None:
        faults.check(cfg)
    t_plan = time.monotonic()
    plan = plan_federated(cfg)
    data, rounds = plan["data"], plan["rounds"]
    torch.manual_seed(cfg.init_seed)
    model = build_model(cfg.model, tuple(data.input_shape), data.num_classes)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.nn.utils.parameters_to_vector(params).detach().clone()
    d = weights.numel()

    plan["run_dir"].mkdir(parents=True, exist_ok=True)
    ledger = dpcore.PrivacyLedger(
        cfg.target_epsilon,
        cfg.target_delta,
        cfg.accountant,
        epsilon_every=max(1, rounds // 20),
        journal=plan["run_dir"] / "ledger.journal.jsonl",
    )
    randomness = dpcore.make_randomness(cfg.seed)
    adaptive = (
        AdaptiveClipping(cfg.clip_norm, cfg.target_quantile, cfg.quantile_lr, cfg.resolved_quantile_noise())
        if cfg.clip_policy == "adaptive"
        else None
    )
    dp = ClientLevelDP(
        cfg.num_clients, cfg.clients_per_round, plan["noise_multiplier"], cfg.clip_norm, ledger, randomness, adaptive
    )
    server_opt = torch.optim.SGD(params, lr=cfg.server_lr, momentum=cfg.server_momentum)

    tracking.open_store(plan["tracking_uri"])
    client = MlflowClient(plan["tracking_uri"])
    mlflow.set_tracking_uri(plan["tracking_uri"])
    with tracking.mlflow_run(
        client,
        experiment=cfg.experiment,
        run_name=plan["run_name"],
        tags=run_tags(cfg, plan, dp.update_noise_multiplier),
        on_failure=lambda run_id: tracking.record_released(client, run_id, ledger),
    ) as run_id:
        params_logged = {k: ("None" if v is None else str(v)) for k, v in cfg.to_dict().items()}
        params_logged.update(
            {
                "plan.noise_multiplier": f"{plan['noise_multiplier']:.8g}",
                "plan.update_noise_multiplier": f"{dp.update_noise_multiplier:.8g}",
                "plan.sample_rate": f"{plan['sample_rate']:.8g}",
                "plan.rounds": str(rounds),
                "plan.rounds_that_fit_budget": str(plan["rounds_that_fit"]),
                "plan.parameters": str(d),
                "plan.client_examples_min_mean_max": "{} / {:.1f} / {}".format(*plan["client_sizes"]),
            }
        )
        client.log_batch(run_id, params=[mlflow.entities.Param(k, v) for k, v in params_logged.items()])
        tracking.write_json_artifact(client, run_id, "config.json", cfg.to_dict())

        every = cfg.eval_every or max(1, rounds // 20)
        expected_down = cfg.clients_per_round * d * BYTES_PER_FLOAT
        expected_up = cfg.clients_per_round * (d * BYTES_PER_FLOAT + (1 if adaptive else 0))
        runner_args = dict(
            x=data.train.x,
            y=data.train.y,
            order=plan["order"],
            offsets=plan["offsets"],
            model_name=cfg.model,
            input_shape=tuple(data.input_shape),
            num_classes=data.num_classes,
            local_epochs=cfg.local_epochs,
            local_batch_size=cfg.local_batch_size,
            local_lr=cfg.local_lr,
            shuffle_seed=cfg.split_seed,
        )
        t0 = time.monotonic()
        realised = {"clients": 0, "bytes_down": 0, "bytes_up": 0}
        history, round_seconds = [], []
        done, pool = 0, None
        audit = None
        if (
            cfg.audit_canaries
        ):  # canary clients, simulated on the server: their clipped update is S(1 − m)·e_j (m = CLIP_MARGIN)
            coords = torch.randperm(d, generator=torch.Generator().manual_seed(cfg.init_seed + 7919))[
                : cfg.audit_canaries
            ]
            member = randomness.spawn("audit-membership").uniform(cfg.audit_canaries) < cfg.audit_canary_rate
            audit = {
                "coords": coords,
                "membership": member,
                "in": coords[member],
                "scores": torch.zeros(cfg.audit_canaries, dtype=torch.float64),
                "sampling": randomness.spawn("audit-sampling"),
            }
        say = _phases(cfg, t0)
        try:
            if cfg.executor == "ray":
                from ..train.cluster import cluster_address

                say("connecting to Ray" if cluster_address(cfg) else "starting Ray")
            with _cluster(cfg) as cluster:
                fault = (faults.at_round, faults.actor) if faults is not None else None
                if cfg.executor == "ray":
                    say(f"starting {cfg.num_actors} client actor(s)")
                pool = (
                    RayPool(runner_args, cfg.num_actors, cfg.cpus_per_actor, cfg.max_actor_restarts, fault)
                    if cfg.executor == "ray"
                    else LocalPool(runner_args, int(cfg.cpus_per_actor))
                )
                say("actors up; the first round")
                t_rounds = time.monotonic()
                started_ms = int(time.time() * 1000)  # the time every round's metrics carry
                for r in range(1, rounds + 1):
                    try:
                        sampled = dp.sample_clients()
                    except dpcore.BudgetExceededError:
                        break
                    t_round = time.monotonic()
                    ids = [int(k) for k in sampled]
                    shares = [ids[i :: cfg.num_actors] for i in range(cfg.num_actors)]
                    s = dp.clip_norm
                    results = pool.run_round(
                        r, weights, shares, s, cfg.clip_policy == "median_nonprivate" or cfg.diagnostics
                    )
                    included = [k for res in results for k in res["clients"]]
                    if sorted(included) != ids:
                        raise RuntimeError(
                            f"round {r}: the clients' results do not match the sampled clients (lost or duplicated updates)"
                        )
                    total = torch.zeros(d, dtype=torch.float64)
                    for res in results:  # actor order: the same sum whichever actor died
                        total += res["sum"]
                    bits = sum(res["bits"] for res in results) if adaptive else None
                    count = len(ids)
                    if audit is not None:  # present canary clients join at rate q, like every client
                        draw = audit["sampling"].uniform(len(audit["in"]))
                        joined = audit["in"][dpcore.sampling.included(draw, dp.sample_rate)]
                        total.index_add_(
                            0,
                            joined,
                            torch.full((len(joined),), s * (1.0 - dpcore.clipping.CLIP_MARGIN), dtype=torch.float64),
                        )
                        count += len(joined)
                        bits = None if bits is None else bits + len(joined)  # ‖S(1 − m)e_j‖ ≤ S
                    noised = dp.release(total, count=count, bits_sum=bits, step=r)
                    if audit is not None:  # white-box score: the released update along each canary's coordinate
                        audit["scores"] += noised[audit["coords"]].double()
                    if cfg.clip_policy == "median_nonprivate":  # NOT PRIVATE (diagnostics only, refused otherwise)
                        norms = [n for res in results for n in res["norms"]]
                        if norms:
                            dp.clip_norm = nonprivate_median_clip_norm(norms)
                    load_flat(params, weights)
                    server_opt.zero_grad(set_to_none=False)
                    for p, g in zip(params, _unflatten(-noised, params)):
                        p.grad = g
                    server_opt.step()
                    weights = torch.nn.utils.parameters_to_vector(params).detach().clone()
                    round_seconds.append(time.monotonic() - t_round)
                    done = r
                    realised["clients"] += len(ids)
                    realised["bytes_down"] += len(ids) * d * BYTES_PER_FLOAT
                    realised["bytes_up"] += len(ids) * (d * BYTES_PER_FLOAT + (1 if adaptive else 0))
                    metrics = {"clip_norm": s, "comm_expected_bytes_total": r * (expected_down + expected_up)}
                    if cfg.diagnostics:
                        metrics.update(
                            {
                                "diag_clients": len(ids),
                                "diag_bytes_down": len(ids) * d * BYTES_PER_FLOAT,
                                "diag_bytes_up": len(ids) * (d * BYTES_PER_FLOAT + (1 if adaptive else 0)),
                            }
                        )
                    if r % every == 0 or r == rounds:
                        eps = ledger.epsilon()
                        dlt = dpcore.accountants.delta(ledger.groups(), cfg.target_epsilon, cfg.accountant)
                        test_acc, test_loss = _evaluate(model, data.test)
                        val_acc, _ = _evaluate(model, data.val) if len(data.val) else (float("nan"), None)
                        elapsed = time.monotonic() - t_rounds
                        metrics.update(
                            {
                                "epsilon": eps,
                                "delta_at_target_epsilon": dlt,
                                "test_accuracy": test_acc,
                                "test_loss": test_loss,
                                "val_accuracy": val_acc,
                            }
                        )
                        history.append({"round": r, "epsilon": eps, "delta": dlt, "test_accuracy": test_acc})
                        if not cfg.quiet:
                            eta = (rounds - r) * elapsed / r
                            print(
                                f"[{'#' * int(24 * r / rounds):.<24}] round {r}/{rounds}  ε={epsilon_text(eps, '.3f')}  "
                                f"δ(ε={cfg.target_epsilon:g})={dlt:.3g}  "
                                f"S={s:.3g}  test acc={test_acc:.4f}  {elapsed:6.1f}s  ETA {eta:6.1f}s",
                                file=sys.stderr,
                                flush=True,
                            )
                    # Every round's metrics carry the rounds' start time, not the round's own: a round
                    # takes longer the more clients it sampled, and that count is not released.
                    client.log_batch(
                        run_id, metrics=[mlflow.entities.Metric(k, float(v), started_ms, r) for k, v in metrics.items()]
                    )
                seconds_rounds = time.monotonic() - t_rounds
                say(f"{done} round(s) done" + ("; stopping the local Ray cluster" if cluster == "started" else ""))
            epsilon = ledger.epsilon()
            say(
                f"ε = {epsilon_text(epsilon, '.4f')} from the run's ledger ({cfg.accountant}); logging the ledger and plots to MLflow"
            )
            dlt = dpcore.accountants.delta(ledger.groups(), cfg.target_epsilon, cfg.accountant) if len(ledger) else 0.0
            test_acc, _ = _evaluate(model, data.test)
            client.set_tag(run_id, "dp.epsilon", epsilon_text(epsilon))
            client.set_tag(run_id, "dp.delta_at_target_epsilon", f"{dlt:.6g}")
            tracking.log_ledger(client, run_id, ledger)
            client.log_metric(run_id, "final_epsilon", epsilon)
            client.log_metric(run_id, "final_test_accuracy", test_acc)
            tracking.describe_run(client, run_id, plan["run_name"], epsilon, cfg.target_delta, cfg.accountant, test_acc)
            client.log_metric(run_id, "rounds", done)
            client.log_metric(run_id, "rounds_per_second", done / max(seconds_rounds, 1e-9))  # once, for the run
            audit_out = None
            if audit is not None:
                r = cfg.resolved_audit_guesses()
                res = dpcore.audit.one_run_audit(
                    audit["scores"].numpy(), audit["membership"].numpy(), r - r // 2, r // 2, delta=cfg.target_delta
                )
                audit_out = {
                    "canaries": res.canaries,
                    "guesses": res.guesses,
                    "correct": res.correct,
                    "epsilon_lower_bound": res.epsilon_lower_bound,
                    "confidence": res.confidence,
                    "included": int(audit["membership"].sum()),
                    "scores": audit["scores"],
                    "coords": audit["coords"],
                    "membership": audit["membership"],
                }
                tracking.log_audit(client, run_id, audit_out, epsilon)
            _plot(client, run_id, ledger, history, cfg)
            example = public_example(data.input_shape)  # never a client's example: the model leaves with the run
            if cfg.log_model:
                say("logging the model to MLflow" + ("" if tracking.skips_registry(cfg) else " and registering it"))
            version = tracking.log_run_model(
                run_id, model, example, epsilon, cfg, prefix="dp-fedavg", no_guarantee=no_guarantee(cfg)
            )
            return {
                "run_id": run_id,
                "tracking_uri": plan["tracking_uri"],
                "dataset": data.name,
                "num_clients": cfg.num_clients,
                "clients_per_round": cfg.clients_per_round,
                "rounds": done,
                "planned_rounds": rounds,
                "epsilon": epsilon,
                "delta_at_target_epsilon": dlt,
                "target_epsilon": cfg.target_epsilon,
                "target_delta": cfg.target_delta,
                "noise_multiplier": plan["noise_multiplier"],
                "update_noise_multiplier": dp.update_noise_multiplier,
                "sample_rate": plan["sample_rate"],
                "test_accuracy": test_acc,
                "final_clip_norm": dp.clip_norm,
                "comm_expected_bytes": done * (expected_down + expected_up),
                "comm_realised": realised,
                "actor_restarts": pool.restarts if pool is not None else 0,
                "seconds": time.monotonic() - t0,
                "seconds_rounds": seconds_rounds,
                "round_seconds": round_seconds,
                "seconds_plan": t0 - t_plan,
                "parameters": d,
                "registered_model": None if version is None else f"{version.name} v{version.version}",
                "ledger": ledger,
                "model": model,
                "history": history,
                "audit": audit_out,
            }
        finally:
            if pool is not None:
                with contextlib.suppress(Exception):
                    pool.close()


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for p in like:
        out.append(flat[i : i + p.numel()].view_as(p).to(p.dtype))
        i += p.numel()
    return out


def _phases(cfg: FederatedConfig, t0: float):
    """A line on stderr for each phase of the run outside its rounds (unless ``quiet``)."""

    def say(text: str) -> None:
        if not cfg.quiet:
            print(f"  {text}  ({time.monotonic() - t0:.1f}s)", file=sys.stderr, flush=True)

    return say


@contextlib.contextmanager
def _cluster(cfg: FederatedConfig):
    """The Ray cluster the actors run on (see :func:`pipelines.train.ray_cluster`); yields how it
    was reached ("started", "joined", "connected"), or "local" without Ray."""
    if cfg.executor != "ray":
        yield "local"
        return
    from ..train import ray_cluster

    # a local cluster with the CPUs the actors ask for (each cpus_per_actor): fewer and one waits for ever
    cpus = math.ceil(cfg.num_actors * cfg.cpus_per_actor)
    with ray_cluster(SimpleNamespace(ray_address=cfg.ray_address, num_workers=cpus, use_gpu=False)) as how:
        yield how


def _plot(client, run_id: str, ledger, history: list[dict], cfg: FederatedConfig) -> None:
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    with tempfile.TemporaryDirectory() as tmp:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        rounds = [h["round"] for h in history]
        axes[0].plot(rounds, [h["epsilon"] for h in history], marker=".", label=f"ε at δ={cfg.target_delta:g}")
        axes[0].axhline(cfg.target_epsilon, color="red", ls="--", lw=1)
        ax2 = axes[0].twinx()
        ax2.semilogy(
            rounds,
            [max(h["delta"], 1e-300) for h in history],
            color="gray",
            marker="x",
            lw=1,
            label=f"δ at ε={cfg.target_epsilon:g}",
        )
        ax2.axhline(cfg.target_delta, color="gray", ls=":", lw=1)
        axes[0].set(xlabel="round", ylabel="ε", title="Client-level privacy spent")
        axes[0].grid(alpha=0.3)
        axes[1].plot(rounds, [h["test_accuracy"] for h in history], marker=".")
        axes[1].set(xlabel="round", ylabel="test accuracy", title="Accuracy of the global model")
        axes[1].grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(Path(tmp) / "federated.png", dpi=110)
        plt.close(fig)
        client.log_artifacts(run_id, tmp, artifact_path="plots")
