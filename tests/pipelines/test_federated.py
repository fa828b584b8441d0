"""Issue E: client-level DP federated averaging (DP-FedAvg) on Ray actors.

The math is checked against independent references: dp_accounting for ε and δ, a replay of
the seeded noise and sampling streams for the server's update, scipy for the client-sample
distribution. The pipeline runs on real Ray actors and a real MLflow store.
"""

import math
import re
import subprocess
import sys

import dp_accounting
import mlflow
import numpy as np
import pytest
import torch
from scipy import stats

import dpcore
from dpcore.clipping import CLIP_MARGIN
from dpcore.federated import AdaptiveClipping, ClientLevelDP, clip_update, split_noise_multiplier
from dpcore.readout import epsilon_text
from dpcore.sampling import PoissonSampler
from pipelines.data import load_digits
from pipelines.federated import ActorFault, FederatedConfig, plan_federated, run_federated
from pipelines.federated.clients import ClientRunner, split_clients

from ..helpers import assert_input_example_is_no_private_row

DIGITS = load_digits()


def _cfg(root, **over):
    base = dict(
        seed=5,
        rounds=3,
        eval_every=1,
        log_model=False,
        quiet=True,
        executor="local",
        num_actors=2,
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        storage_path=str(root / "runs"),
    )
    return FederatedConfig(**{**base, **over})


def _runner(order, offsets, lr=0.1, epochs=1):
    return ClientRunner(
        DIGITS.inputs("train"), DIGITS.train.y, order, offsets, "mlp", (1, 8, 8), 10, epochs, 10, lr, shuffle_seed=0
    )


def _initial_weights(seed=0):
    from pipelines.models import build_model

    torch.manual_seed(seed)
    m = build_model("mlp", (1, 8, 8), 10)
    return torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()


# ------------------------------------------------------------------------------------------
# Clipping: each client's contribution has norm ≤ S.
def test_clip_update_bounds_every_update_and_keeps_small_ones():
    g = torch.Generator().manual_seed(0)
    for scale in (1e-8, 0.3, 1.0, 7.0, 1e6, 1e30):
        u = torch.randn(5000, generator=g) * scale
        clipped, norm, finite = clip_update(u, 1.5)
        assert finite and clipped.norm().item() <= 1.5
        if norm <= 1.5 * (1 - CLIP_MARGIN):
            assert torch.equal(clipped, u.double())
        else:
            assert clipped.norm().item() == pytest.approx(1.5 * (1 - CLIP_MARGIN), rel=1e-12)
            assert torch.allclose(clipped / clipped.norm(), u.double() / u.double().norm())
    bad = torch.ones(10)
    bad[3] = float("nan")
    clipped, norm, finite = clip_update(bad, 1.0)
    assert not finite and not clipped.any()


def test_each_clients_contribution_has_norm_at_most_S_and_the_round_weights_are_untouched():
    order, offsets = split_clients(DIGITS.train.y, 40, "noniid", 2, seed=0)
    runner = _runner(order, offsets, lr=0.5, epochs=3)  # large local steps: most updates exceed S
    w = _initial_weights()
    before = w.clone()
    S = 0.25
    single = []
    for k in range(40):
        out = runner.run(1, w, [k], S)
        assert out["sum"].norm().item() <= S
        single.append(out["sum"])
    assert torch.equal(w, before), "local training wrote into the round's global weights"
    assert sum(out["bits"] for out in [runner.run(1, w, [k], S) for k in range(40)]) < 40  # some were clipped
    together = runner.run(1, w, list(range(40)), S)
    assert torch.allclose(together["sum"], torch.stack(single).sum(0), atol=1e-12)
    assert together["clients"] == list(range(40))


def test_a_clients_update_does_not_depend_on_the_clients_before_it_with_dropout():
    """Dropout draws from torch's global generator: shared by the clients of one share, one
    client's data (how many draws its batches took) changed every later client's masks, so that
    with a client added the sum moved by more than S (helper-24's review: 0.774 at S = 0.25).
    Each client now draws from a generator of its own (public seed, round, client)."""
    order, offsets = split_clients(DIGITS.train.y, 12, "iid", seed=0)
    runner = _runner(order, offsets, lr=0.5, epochs=2)
    torch.manual_seed(0)
    runner.model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 10)
    )
    runner.params = list(runner.model.parameters())
    w = torch.nn.utils.parameters_to_vector(runner.params).detach().clone()
    S, j = 0.25, 0
    torch.manual_seed(1)
    alone = runner.run(1, w, [j], S)["sum"]
    assert not torch.equal(alone, runner.run(2, w, [j], S)["sum"])  # dropout is on: another round, other masks
    singles = [runner.run(1, w, [k], S)["sum"] for k in range(12)]
    assert torch.equal(singles[j], alone)
    with_j = runner.run(1, w, list(range(12)), S)["sum"]
    without_j = runner.run(1, w, list(range(1, 12)), S)["sum"]
    assert torch.allclose(with_j, torch.stack(singles).sum(0), atol=1e-12)
    assert (with_j - without_j).norm().item() <= S + 1e-9  # the sensitivity the accountant assumes
    before = torch.random.get_rng_state()
    runner.run(3, w, [1, 2], S)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's generator is left as it was


# ------------------------------------------------------------------------------------------
# Splits.
def test_noniid_split_sorts_by_label_into_shards_and_covers_every_example_once():
    y = DIGITS.train.y
    order, offsets = split_clients(y, 100, "noniid", 2, seed=1)
    assert torch.equal(torch.sort(order).values, torch.arange(len(y)))
    sizes = offsets[1:] - offsets[:-1]
    shard = len(y) // 200
    assert int(sizes.min()) >= 2 * shard and int(sizes.max()) <= 2 * (shard + 1)
    labels_per_client = [len(set(y[order[offsets[k] : offsets[k + 1]]].tolist())) for k in range(100)]
    assert max(labels_per_client) <= 4 and np.mean(labels_per_client) < 2.6  # two label-sorted shards each
    iid_order, iid_offsets = split_clients(y, 100, "iid", seed=1)
    iid_labels = [len(set(y[iid_order[iid_offsets[k] : iid_offsets[k + 1]]].tolist())) for k in range(100)]
    assert np.mean(iid_labels) > np.mean(labels_per_client) + 2
    assert int((iid_offsets[1:] - iid_offsets[:-1]).max() - (iid_offsets[1:] - iid_offsets[:-1]).min()) <= 1


# ------------------------------------------------------------------------------------------
# Sampling: Poisson over clients, the count is Binomial(K, m/K).
def test_client_sampling_follows_binomial_K_q():
    K, m, rounds = 200, 20, 4000
    ledger = dpcore.PrivacyLedger(None, 1e-5)
    dp = ClientLevelDP(K, m, 1.0, 1.0, ledger, dpcore.SeededRandomness(11))
    counts, hits = [], torch.zeros(K)
    for _ in range(rounds):
        s = dp.sample_clients()
        counts.append(len(s))
        hits[s] += 1
    counts = np.array(counts)
    q = m / K
    # Chi-square of the count histogram against Binomial(K, q), with tail bins merged.
    edges = np.arange(8, 33)
    observed = np.array(
        [(counts < edges[0]).sum()] + [(counts == e).sum() for e in edges] + [(counts > edges[-1]).sum()]
    )
    p = np.array(
        [stats.binom.cdf(edges[0] - 1, K, q)]
        + [stats.binom.pmf(e, K, q) for e in edges]
        + [stats.binom.sf(edges[-1], K, q)]
    )
    assert stats.chisquare(observed, p * rounds).pvalue > 1e-3
    # Each client joins at rate q (a fixed-size sample would too, so also check the count varies as a binomial).
    assert counts.var() == pytest.approx(K * q * (1 - q), rel=0.1)
    se = math.sqrt(q * (1 - q) / rounds)
    assert float((hits / rounds - q).abs().max()) < 5 * se


# ------------------------------------------------------------------------------------------
# Noise: once per round, std z·S (z_Δ·S with adaptive clipping), whatever the actors.
@pytest.mark.parametrize("executor,actors", [("local", 1), ("ray", 2)])
def test_noise_is_added_once_per_round_with_std_zS(tmp_path, executor, actors, request):
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    z, S, m, R = 2.0, 0.5, 30, 3
    out = run_federated(
        _cfg(
            tmp_path,
            executor=executor,
            num_actors=actors,
            noise_multiplier=z,
            clip_norm=S,
            rounds=R,
            clients_per_round=m,
            local_lr=0.0,
            server_lr=1.0,
        )
    )
    assert out["rounds"] == R and len(out["ledger"]) == R
    moved = (
        torch.nn.utils.parameters_to_vector(out["model"].parameters()).detach().double() - _initial_weights().double()
    )
    n = moved.numel()
    expected = math.sqrt(R) * z * S / m  # R independent draws of N(0, z²S²) / m per coordinate
    assert moved.mean().abs().item() < 5 * expected / math.sqrt(n)
    assert moved.std().item() == pytest.approx(
        expected, rel=5 / math.sqrt(2 * n)
    )  # noise ×√2 (twice per round) is 41 % off


def _replay(seed, K, m, z, S, rounds, lr_server, adaptive=None):
    """The server's update rebuilt from the seeded streams and the clients' code, independently
    of the pipeline's loop: w ← w + η·(Σ clip(Δ_k) + N(0, z_Δ²S²)) / m."""
    order, offsets = split_clients(DIGITS.train.y, K, "noniid", 2, seed=0)
    runner = _runner(order, offsets)
    rng = dpcore.SeededRandomness(seed)
    sampler, noise = rng.spawn("clients"), rng.spawn("server-noise")
    w = _initial_weights()
    q = m / K
    z_delta = split_noise_multiplier(z, adaptive["quantile_noise"]) if adaptive else z
    for r in range(1, rounds + 1):
        clients = torch.arange(K)[sampler.uniform(K) < q].tolist()
        shares = [clients[0::2], clients[1::2]]
        outs = [runner.run(r, w, s, S) for s in shares]
        total = outs[0]["sum"] + outs[1]["sum"]
        update = (total + noise.normal(w.shape, std=z_delta * S, dtype=torch.float64)) / m
        if adaptive:
            bits = outs[0]["bits"] + outs[1]["bits"] - 0.5 * len(clients)
            noisy = bits + float(noise.normal((1,), std=adaptive["quantile_noise"], dtype=torch.float64)[0])
            S = S * math.exp(-adaptive["lr"] * (noisy / m + 0.5 - adaptive["gamma"]))
        w = w + lr_server * update.float()
    return w, S


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_server_update_is_the_noised_clipped_sum_over_m(tmp_path, policy):
    K, m, z, S, R = 50, 10, 1.1, 0.3, 3
    extra = (
        dict(clip_policy="adaptive", quantile_noise=2.0, target_quantile=0.3, quantile_lr=0.5)
        if policy == "adaptive"
        else {}
    )
    out = run_federated(
        _cfg(
            tmp_path,
            num_clients=K,
            clients_per_round=m,
            noise_multiplier=z,
            clip_norm=S,
            rounds=R,
            server_lr=0.7,
            **extra,
        )
    )
    adaptive = dict(quantile_noise=2.0, gamma=0.3, lr=0.5) if policy == "adaptive" else None
    expected, final_s = _replay(5, K, m, z, S, R, 0.7, adaptive)
    got = torch.nn.utils.parameters_to_vector(out["model"].parameters()).detach()
    assert torch.allclose(got, expected, atol=1e-5)
    assert out["final_clip_norm"] == pytest.approx(final_s, rel=1e-9)
    if policy == "adaptive":
        assert final_s != S
        # The ledger records the S of each round and one event of the joint noise z per round.
        assert [e.noise_multiplier for e in out["ledger"].entries] == [z] * R
        assert out["update_noise_multiplier"] == pytest.approx((z**-2 - 4.0**-2) ** -0.5)


def test_adaptive_clipping_bits_and_update_compose_to_one_gaussian_of_z():
    """Andrew et al., Thm 1, checked with dp_accounting on the unsampled mechanism: a Gaussian
    of z_Δ on the update and one of 2σ_b on the centred bit sum compose to a Gaussian of z."""
    z, sigma_b = 1.3, 1.5
    z_delta = split_noise_multiplier(z, sigma_b)
    both = dp_accounting.pld.PLDAccountant()
    both.compose(dp_accounting.GaussianDpEvent(z_delta))
    both.compose(dp_accounting.GaussianDpEvent(2 * sigma_b))
    one = dp_accounting.pld.PLDAccountant()
    one.compose(dp_accounting.GaussianDpEvent(z))
    assert both.get_epsilon(1e-5) == pytest.approx(one.get_epsilon(1e-5), rel=1e-3)
    with pytest.raises(dpcore.DPConfigError, match="quantile_noise"):
        split_noise_multiplier(2.0, 0.9)
    a = AdaptiveClipping(1.0, target_quantile=0.5, learning_rate=0.2, quantile_noise=1.0)
    assert a.update(1.0) == pytest.approx(math.exp(-0.1))  # all updates under S: S shrinks
    assert a.update(0.0) == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------
# Accounting: the ledger's ε equals dp_accounting's; Geyer's rule stops at the right round.
def test_ledger_epsilon_equals_dp_accounting(tmp_path):
    out = run_federated(_cfg(tmp_path, rounds=6, target_epsilon=5.0, target_delta=1e-3))
    q, z = out["sample_rate"], out["noise_multiplier"]
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(event, 6)
    assert out["epsilon"] == pytest.approx(pld.get_epsilon(1e-3), rel=1e-6)
    assert out["epsilon"] <= 5.0
    assert out["delta_at_target_epsilon"] == pytest.approx(pld.get_delta(5.0), rel=1e-6)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(event, 6)
    assert dpcore.epsilon(out["ledger"].groups(), 1e-3, "rdp") == pytest.approx(rdp.get_epsilon(1e-3), rel=1e-9)
    entries = out["ledger"].entries
    assert [e.step for e in entries] == [1, 2, 3, 4, 5, 6] and {e.kind for e in entries} == {"poisson_gaussian"}


def test_a_runs_logs_carry_no_per_round_time(tmp_path):
    """A round takes longer the more clients it sampled, and that count is not released: every
    round's metrics carry one time (the rounds' start), the throughput is logged once for the
    run, and the ledger table in MLflow has no per-release time."""
    import mlflow
    import pyarrow.parquet as pq

    out = run_federated(_cfg(tmp_path, rounds=4, target_epsilon=5.0, target_delta=1e-3))
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = out["run_id"]
    for key in ("clip_norm", "epsilon", "test_accuracy"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == [1, 2, 3, 4]
        assert len({m.timestamp for m in history}) == 1, key
    assert len(client.get_metric_history(run_id, "rounds_per_second")) == 1
    table = pq.read_table(client.download_artifacts(run_id, "ledger/ledger.parquet", str(tmp_path)))
    assert "timestamp" not in table.column_names and table.num_rows == 4


def test_a_run_planned_past_its_budget_stops_at_the_budget_without_sampling_again(tmp_path, monkeypatch):
    """The plan caps the rounds at what the budget allows; should it ever plan more (here it is
    made to), the round loop stops where the ledger's check refuses the next round, before that
    round's clients are sampled, with ε within the target; and a seedless run's sampler and
    noise are the secure ones."""
    from pipelines.federated import rounds as rounds_module

    real_plan, sampled = rounds_module.plan_federated, []

    def planned_past_the_budget(cfg):
        plan = real_plan(cfg)
        sampled.append(plan["rounds"])
        return {**plan, "rounds": plan["rounds"] + 3}

    monkeypatch.setattr(rounds_module, "plan_federated", planned_past_the_budget)
    draws = []
    real_sample = PoissonSampler.sample

    def counted(self):  # the client sampler's draws, and their source
        draws.append(type(self.randomness).__name__)
        return real_sample(self)

    monkeypatch.setattr(PoissonSampler, "sample", counted)
    noise = []
    real_release = ClientLevelDP.release

    def noise_source(self, *args, **kwargs):
        noise.append(type(self._noise).__name__)
        return real_release(self, *args, **kwargs)

    monkeypatch.setattr(ClientLevelDP, "release", noise_source)
    cfg = _cfg(tmp_path, seed=None, noise_multiplier=1.7, rounds=40, target_epsilon=2.0, target_delta=1e-3)
    out = run_federated(cfg)
    fits = sampled[0]
    assert 0 < fits < 40 and out["planned_rounds"] == fits + 3  # budget-limited, and planned past it
    assert out["rounds"] == fits and len(out["ledger"].entries) == fits
    assert len(draws) == fits and set(draws) == {"SecureRandomness"}  # the refused round sampled nobody
    assert len(noise) == fits and set(noise) == {"SecureRandomness"}
    assert out["epsilon"] <= 2.0
    event = out["ledger"].entries[0].event
    assert out["ledger"].allowance(event) == 0
    tags = mlflow.MlflowClient(cfg.tracking_uri).get_run(out["run_id"]).data.tags
    assert tags["dp.randomness"] == "secure"


def test_a_model_trained_without_a_guarantee_is_registered_without_an_epsilon(tmp_path):
    """Geyer et al.'s non-private median clip (diagnostics only): the run says it holds no
    guarantee, and so do its registered model version and the model itself; a private run's
    version carries ε, δ and the accountant."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for policy, name in (("median_nonprivate", "fed-median"), ("fixed", "fed-fixed")):
        out = run_federated(
            _cfg(tmp_path, rounds=2, clip_policy=policy, diagnostics=True, log_model=True, registered_model=name)
        )
        version = client.get_model_version(name, "1")
        model_tags = client.get_logged_model(version.source.removeprefix("models:/")).tags  # the logged model itself
        run_tags = client.get_run(out["run_id"]).data.tags
        if policy == "median_nonprivate":
            assert run_tags["dp.guarantee"].startswith("NONE: ")
            assert version.tags == {"dp.epsilon": "none", "dp.guarantee": run_tags["dp.guarantee"][len("NONE: ") :]}
            assert version.description.startswith("No differential-privacy guarantee: S is the non-private median")
            assert model_tags.get("dp.epsilon") == "none"
        else:
            assert version.tags["dp.epsilon"] == epsilon_text(out["epsilon"]) and version.tags["dp.accountant"] == "pld"
            assert "dp.guarantee" not in version.tags and version.description.startswith("Trained with (ε=")


def test_geyer_stopping_rule_stops_at_the_last_round_with_delta_below_Q(tmp_path):
    K, m, z, eps, Q = 100, 30, 1.4, 3.0, 1e-4
    out = run_federated(
        _cfg(
            tmp_path,
            num_clients=K,
            clients_per_round=m,
            noise_multiplier=z,
            rounds=0,
            stopping="delta",
            target_epsilon=eps,
            target_delta=Q,
            eval_every=100,
        )
    )
    # Independently: compose one round at a time with dp_accounting and find the first round whose δ(ε) > Q.
    acc = dp_accounting.pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(m / K, dp_accounting.GaussianDpEvent(z))
    t = 0
    while True:
        acc.compose(event)
        if acc.get_delta(eps) > Q:
            break
        t += 1
    assert 3 <= t and out["rounds"] == t
    assert out["delta_at_target_epsilon"] <= Q < acc.get_delta(eps)


# ------------------------------------------------------------------------------------------
# Ray actors: a killed actor neither loses nor duplicates a client's update.
def test_killed_actor_is_replaced_and_the_round_neither_loses_nor_duplicates_updates(tmp_path, ray_cluster):
    common = dict(num_actors=2, noise_multiplier=1.0, rounds=4)
    for d in "ab":
        (tmp_path / d).mkdir()
    # The reference: the same seed in one process (the same code and arithmetic as the actors).
    clean = run_federated(_cfg(tmp_path / "a", executor="local", **common))
    killed = run_federated(_cfg(tmp_path / "b", executor="ray", **common), faults=ActorFault(at_round=2, actor=1))
    assert killed["actor_restarts"] == 1 and clean["actor_restarts"] == 0
    # Same clients, same noise: the redone share gives the very same model ...
    w_clean = torch.nn.utils.parameters_to_vector(clean["model"].parameters())
    w_killed = torch.nn.utils.parameters_to_vector(killed["model"].parameters())
    assert torch.equal(w_clean, w_killed)
    # ... the same number of client updates, and one ledger entry per round, none repeated.
    assert killed["comm_realised"] == clean["comm_realised"]
    assert [e.step for e in killed["ledger"].entries] == [1, 2, 3, 4]
    assert killed["epsilon"] == clean["epsilon"]


# ------------------------------------------------------------------------------------------
# Bad input: a clear error before any round.
@pytest.mark.parametrize(
    "over,match",
    [
        (dict(clients_per_round=150, num_clients=100), "exceeds num_clients"),
        (dict(clip_norm=0.0), "clip_norm"),
        (dict(clip_norm=-1.0), "clip_norm"),
        (dict(split="iid", num_clients=2000), "no data"),
        (dict(num_clients=700, shards_per_client=2), "shards"),
        (dict(clip_policy="median_nonprivate"), "NOT|not private|releases private"),
        (dict(noise_multiplier=1.0, rounds=0, target_epsilon=0.01), "not one round fits"),
        (dict(rounds=0), "needs a given --noise-multiplier"),
        (dict(clip_policy="adaptive", noise_multiplier=3.0, quantile_noise=1.0), "too small"),
        # helper-42: taken without a word with the fixed policy (only quantile_noise was refused)
        (dict(target_quantile=2.0), r"target_quantile=2.0 has no effect with clip_policy='fixed'"),
        (dict(quantile_lr=5.0), r"quantile_lr=5.0 has no effect with clip_policy='fixed'"),
        # helper-42: σ = 0.01 (a typo for 1.0) built its PLD for minutes before refusing
        (dict(noise_multiplier=0.01, rounds=0, target_epsilon=8.0), "not one round fits"),
    ],
)
def test_bad_input_fails_before_any_round(tmp_path, over, match):
    with pytest.raises(dpcore.DPConfigError, match=match):
        plan_federated(_cfg(tmp_path, **over))
    assert not (tmp_path / "runs").exists()  # nothing started, no ledger


def test_client_actors_that_the_cluster_cannot_hold_are_refused_not_waited_for(ray_cluster):
    """helper-42: actors asking for more CPUs than the cluster has were never scheduled, and the
    run waited for ever without a word. The tests' cluster has 2 CPUs: 2 actors of 2 CPUs each
    are refused before any actor is made, naming what to lower."""
    from pipelines.federated.pools import RayPool

    args = {"x": torch.zeros(4, 2), "y": torch.zeros(4, dtype=torch.long), "order": torch.arange(4), "offsets": [0, 4]}
    with pytest.raises(
        dpcore.DPConfigError, match=r"2 client actors of 2 CPU\(s\) each need 4 CPUs; the Ray cluster has 2"
    ):
        RayPool(args, n=2, cpus_per_actor=2.0, max_restarts=0)


def test_client_with_no_data_is_named():
    with pytest.raises(dpcore.DPConfigError, match="1258 training examples over num_clients=1300"):
        split_clients(DIGITS.train.y, 1300, "iid")


# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_runs_on_ray_and_tracks_the_run_at_client_level(tmp_path, ray_env):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "federated",
            "--rounds",
            "4",
            "--seed",
            "1",
            "--clip-policy",
            "adaptive",
            "--tracking-uri",
            uri,
            "--storage-path",
            str(tmp_path / "runs"),
            "--eval-every",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=ray_env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round 4/4" in proc.stderr and "ε=" in proc.stderr and "test acc=" in proc.stderr
    err = proc.stderr.splitlines()
    assert err[0].startswith("warning: ") and "seed" in err[0]  # --seed 1: predictable noise, said plainly
    assert sum(line.startswith("warning: ") and "seed" in line for line in proc.stdout.splitlines()) == 1  # and again
    phases = [line.split("  (")[0].strip() for line in err if line.startswith("  ")]
    assert phases[:3] == ["connecting to Ray", "starting 2 client actor(s)", "actors up; the first round"], phases
    assert phases[3] == "4 round(s) done" and phases[4].startswith("ε = ") and "logging the model" in phases[5]
    assert "client-level" in proc.stdout
    log = re.search(r"^logs: (\S+) \(MLflow, Ray(; \d+ warnings? there)?\)$", proc.stdout, re.M).group(
        1
    )  # libraries' log
    assert not re.search(r"\b(WARNING|ERROR)\b", proc.stderr + proc.stdout), proc.stderr  # K, must-show 4
    # MLflow's set-up lines are in the file (its schema check, run by Alembic: a new store is
    # copied from the cached schema, so MLflow builds none), none on the terminal
    assert log.startswith(str(tmp_path / "runs" / "logs" / "federated-")) and "INFO alembic.runtime" in open(log).read()
    assert "Creating initial MLflow database tables" not in proc.stderr and "alembic" not in proc.stderr
    client = mlflow.MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("dp-federated").experiment_id])[0]
    tags = run.data.tags
    assert tags["dp.level"] == "client" and tags["dp.clip_policy"] == "adaptive" and float(tags["dp.epsilon"]) <= 8.0
    assert "dp.diagnostics" not in tags and "diag_clients" not in run.data.metrics
    names = {a.path for d in ("", "ledger", "plots") for a in client.list_artifacts(run.info.run_id, d or None)}
    assert {"config.json", "ledger/ledger.parquet", "ledger/ledger.json", "plots/federated.png"} <= names
    from pipelines.cli import fetch_ledger

    assert fetch_ledger(run.info.run_id, uri).num_rows == 4
    version = client.get_latest_versions("dp-fedavg-digits-mlp")[0]
    assert version.run_id == run.info.run_id and version.tags["dp.epsilon"] == tags["dp.epsilon"]
    rows = torch.cat([DIGITS.inputs(s) for s in ("train", "val", "test")])
    mlflow.set_tracking_uri(uri)
    assert_input_example_is_no_private_row(f"models:/dp-fedavg-digits-mlp/{version.version}", rows, tmp_path)
