"""Issue G: audits. The statistics are checked against scipy; every mechanism's measured
lower bound stays below its ledger ε; and the audit has power: the same mechanism with its
noise scaled by 1/√2 (monkeypatched) is caught.

Sizes: d = 2000 coordinates, 400 canaries, 500 releases (about 10⁵ "in" and 9·10⁵ "out"
scores; DP-PCA: d = 256, 128 canaries, 1,500 releases) at σ = 1.5, or b/C = 1 for Laplace.
The privacy curve is checked at δ = 1e-3, a point these sample sizes resolve (at δ = 1e-5 the
audit would need the 1e-5 tails): one release claims ε = 1.91 (Gaussian) or 1.0 (Laplace);
the correct mechanisms measure ε_lb ≈ 1.6–1.7 and 0.98, the broken ones 2.5–2.8 and 1.39.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

import dpcore
from dpcore import audit
from pipelines.audit import claimed_epsilon, mechanism_audit, mechanism_audits


# ------------------------------------------------------------------------------------------
# Statistics, against scipy.
def test_binomial_tails_and_clopper_pearson_match_scipy():
    for n, p in [(1000, 0.3), (10, 0.99), (200_000, 1e-4)]:
        for v in (0, 1, 3, 50, 300, 999):
            if v <= n:
                assert audit.binomial_sf(v, n, p) == pytest.approx(stats.binom.sf(v - 1, n, p), rel=1e-9, abs=1e-300)
                assert audit.binomial_cdf(v, n, p) == pytest.approx(stats.binom.cdf(v, n, p), rel=1e-9, abs=1e-300)
    for k, n in [(0, 100), (5, 100), (100, 1_000_000), (99_990, 100_000), (100, 100)]:
        lo, hi = audit.clopper_pearson(k, n, 0.975)
        assert lo == pytest.approx(0.0 if k == 0 else stats.beta.ppf(0.025, k, n - k + 1), rel=1e-9, abs=1e-15)
        assert hi == pytest.approx(1.0 if k == n else stats.beta.ppf(0.975, k + 1, n - k), rel=1e-9)


def test_one_run_p_value_is_the_binomial_tail_plus_the_delta_term_and_saturates_near_5_8():
    m, r, v = 1000, 500, 400
    q = 1 / (1 + math.exp(-1.0))
    assert audit.one_run_p_value(m, r, v, 1.0, 0.0) == pytest.approx(stats.binom.sf(v - 1, r, q), rel=1e-9)
    # δ > 0 only adds: the α·2mδ term, with α = max_i P[v > B ≥ v − i]/i computed here with scipy.
    alpha = max(sum(stats.binom.pmf(v - j, r, q) for j in range(1, i + 1)) / i for i in range(1, v + 1))
    assert audit.one_run_p_value(m, r, v, 1.0, 1e-6) == pytest.approx(
        stats.binom.sf(v - 1, r, q) + alpha * 2 * m * 1e-6, rel=1e-9
    )
    # All of 1,000 guesses right: ε_lb = log(q/(1−q)) with q = 0.05^(1/1000), about 5.8.
    q95 = 0.05 ** (1 / 1000)
    assert audit.one_run_epsilon_lower_bound(1000, 1000, 1000, 0.0) == pytest.approx(
        math.log(q95 / (1 - q95)), rel=1e-6
    )
    assert 5.7 < audit.one_run_epsilon_lower_bound(1000, 1000, 1000, 1e-5) < 5.82


def _reference_p_value(m, r, v, eps, delta):
    """Steinke et al.'s Algorithm 2 written from the paper with scipy: the tail P[Bin(r, q) ≥ v],
    q = 1/(1 + e^−ε), plus 2mδ·max_{1≤i≤v} P[v > B ≥ v − i]/i."""
    q = 1 / (1 + math.exp(-eps))
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[B = v−1], P[B = v−2], …, P[B = 0]
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1))) if v else 0.0
    return float(stats.binom.sf(v - 1, r, q)) + 2 * m * delta * alpha


@pytest.mark.parametrize(
    "m, r, v, delta, independent",
    [  # `independent`: a 50-digit mpmath evaluation of the same algorithm (helper-27's review)
        (1000, 1000, 1000, 1e-5, 5.78228),
        (1000, 200, 200, 1e-3, 1.7305),
        (1000, 200, 188, 1e-5, 2.2457),
        (100, 100, 90, 1e-4, None),
        (10_000, 2_000, 1_400, 1e-6, None),
    ],
)
def test_one_run_bound_with_delta_equals_an_independent_search(m, r, v, delta, independent):
    """The bound at δ > 0 is where the reference p-value crosses β = 0.05 (a search that left δ
    out gives 5.809 for the first case and 4.194 for the second, and fails here)."""
    ours = audit.one_run_epsilon_lower_bound(m, r, v, delta)
    lo, hi = 0.0, 50.0
    for _ in range(60):  # the reference p-value rises with ε: bisect for its crossing of β
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _reference_p_value(m, r, v, mid, delta) <= 0.05 else (lo, mid)
    assert ours == pytest.approx(lo, abs=1e-6)
    # (the two evaluations of the p-value differ in the last bits: 1e-12 of room)
    assert _reference_p_value(m, r, v, ours, delta) <= 0.05 + 1e-12 < _reference_p_value(m, r, v, ours + 1e-5, delta)
    if independent is not None:
        assert ours == pytest.approx(independent, abs=1e-4)


def test_one_run_bound_holds_for_randomised_response_at_its_confidence():
    """Simulate an ε-DP mechanism exactly (randomised response on 1,000 canaries) 400 times:
    the bound may exceed ε in at most 5 % of runs, so in no more runs than Binomial(400, 0.05)
    reaches once in a thousand (35); it is near ε. At δ = 10⁻⁵ the same runs bound no higher."""
    rng = np.random.default_rng(0)
    eps, m = 1.0, 1000
    q = math.exp(eps) / (1 + math.exp(eps))
    over, bounds = 0, []
    for _ in range(400):
        included = rng.random(m) < 0.5
        report = np.where(rng.random(m) < q, included, ~included)  # ε-DP randomised response
        scores = report.astype(float) + rng.random(m) * 1e-3
        res = audit.one_run_audit(scores, included, 300, 300, delta=0.0)
        bounds.append(res.epsilon_lower_bound)
        over += res.epsilon_lower_bound > eps
        with_delta = audit.one_run_audit(scores, included, 300, 300, delta=1e-5)
        assert with_delta.correct == res.correct and with_delta.epsilon_lower_bound <= res.epsilon_lower_bound
    assert over <= stats.binom.ppf(0.999, 400, 0.05) == 35 and np.median(bounds) > 0.6


def test_distinguishing_bound_holds_for_an_exact_gaussian_mechanism():
    rng = np.random.default_rng(1)
    sigma = 1.5
    eps = claimed_epsilon("pca", sigma, 1.0, 1e-5)  # a plain Gaussian release of sensitivity 1
    found = [
        audit.distinguishing_epsilon_lower_bound(
            1 + sigma * rng.standard_normal(200_000), sigma * rng.standard_normal(2_000_000), 1e-5, seed=s
        ).epsilon_lower_bound
        for s in range(3)
    ]
    assert max(found) <= eps and min(found) > 0.5 * eps


# ------------------------------------------------------------------------------------------
# Every mechanism: ε_lb ≤ the ledger's ε, with 1 and 2 workers.
CASES = [("dpsgd", 1), ("bam", 1), ("dpadam-laplace", 1), ("fedavg", 1), ("fedavg", 2), ("pca", 1)]


DELTA = 1e-3


def _sizes(mechanism):
    if mechanism == "pca":  # d×d noise per release: smaller releases, more of them
        return dict(dim=256, canaries=128, repetitions=1500, delta=DELTA)
    return dict(dim=2000, canaries=400, repetitions=500, delta=DELTA)


def _sigma(mechanism):
    return 1.0 if mechanism == "dpadam-laplace" else 1.5  # b/C = 1 (ε = 1) or σ = 1.5 (ε = 2.75)


@pytest.mark.parametrize("mechanism,workers", CASES)
def test_audit_lower_bound_never_exceeds_the_ledger_epsilon(mechanism, workers):
    res = mechanism_audit(mechanism, workers=workers, noise_multiplier=_sigma(mechanism), seed=3, **_sizes(mechanism))
    assert res.epsilon_lower_bound <= res.epsilon
    assert res.epsilon_lower_bound > 0.7 * res.epsilon  # the audit is close: it would see a real leak


def test_audits_with_two_gloo_workers_never_exceed_the_ledger_epsilon():
    """DP-SGD, BAM and the Laplace form with the clipped sum split over two processes, rank 0
    alone adding the noise, and a real gloo all-reduce (one pair of processes for the three)."""
    mechanisms = ["dpsgd", "bam", "dpadam-laplace"]
    results = mechanism_audits(
        mechanisms, noise_multipliers={m: _sigma(m) for m in mechanisms}, workers=2, seed=3, **_sizes("dpsgd")
    )
    for res in results:
        assert res.workers == 2 and res.epsilon_lower_bound <= res.epsilon, res
        assert res.epsilon_lower_bound > 0.7 * res.epsilon, res


def test_audit_of_a_subsampled_step_stays_below_its_epsilon():
    res = mechanism_audit(
        "dpsgd", noise_multiplier=1.0, sample_rate=0.5, seed=4, dim=2000, canaries=400, repetitions=500, delta=DELTA
    )
    assert 0 < res.epsilon_lower_bound <= res.epsilon


# ------------------------------------------------------------------------------------------
# Power: noise scaled by 1/√2 is caught.
@pytest.fixture
def noise_too_small(monkeypatch):
    normal, laplace = dpcore.SeededRandomness.normal, dpcore.Randomness.laplace

    def small_normal(self, shape, std, dtype=torch.float32, device=None):
        return normal(self, shape, std / math.sqrt(2.0), dtype=dtype, device=device)

    def small_laplace(self, shape, scale, dtype=torch.float32, device=None):
        return laplace(self, shape, scale / math.sqrt(2.0), dtype=dtype, device=device)

    monkeypatch.setattr(dpcore.SeededRandomness, "normal", small_normal)
    monkeypatch.setattr(dpcore.Randomness, "laplace", small_laplace)


@pytest.mark.parametrize("mechanism", ["dpsgd", "bam", "dpadam-laplace", "fedavg", "pca"])
def test_noise_scaled_by_one_over_root_two_is_caught(noise_too_small, mechanism):
    res = mechanism_audit(mechanism, noise_multiplier=_sigma(mechanism), seed=3, **_sizes(mechanism))
    assert res.epsilon_lower_bound > res.epsilon, res


def test_bad_audit_input():
    with pytest.raises(dpcore.DPConfigError, match="canaries"):
        mechanism_audit("dpsgd", dim=10, canaries=11, repetitions=2)
    with pytest.raises(dpcore.DPConfigError, match="mechanism"):
        mechanism_audit("dp-magic", dim=10, canaries=5, repetitions=2)
    with pytest.raises(dpcore.DPConfigError, match="guesses"):
        audit.one_run_audit([0.1, 0.2], [True, False], 2, 1, delta=1e-5)
    with pytest.raises(dpcore.DPConfigError, match="confidence"):
        audit.one_run_epsilon_lower_bound(10, 10, 10, 0.0, confidence=1.5)
    # helper-43: a traceback (torch.cat of nothing), and a refusal that named guesses nobody gave
    with pytest.raises(dpcore.DPConfigError, match=r"repetitions=0: the audit needs at least one release"):
        mechanism_audit("dpsgd", dim=10, canaries=5, repetitions=0)
    from pipelines.config import TrainConfig

    with pytest.raises(dpcore.DPConfigError, match=r"audit_canaries=1 is too few.*m ≥ 2"):
        TrainConfig(audit_canaries=1).validate()


@pytest.mark.parametrize(
    "yaml_text, flags, m",
    [
        ("audit_canaries: 300\naudit_kind: input\n", {}, 300),  # a flat YAML's m
        ("audit:\n  audit_canaries: 300\n", {}, 300),  # a sectioned YAML's
        ("audit_canaries: 300\n", {"audit_canaries": 400}, 400),  # a flag over the YAML
        ("epochs: 2\n", {}, 1000),  # neither: the audit's default m
    ],
)
def test_the_audit_command_trains_with_the_canaries_its_config_asks_for(tmp_path, yaml_text, flags, m):
    """helper-43: `dp-platform audit run.yaml` put m = 1000 among the flags whenever no flag gave
    it, and flags override the YAML: a YAML's audit_canaries was ignored."""
    from pipelines.audit.cli import audit_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    assert audit_config(str(path), dict(flags)).audit_canaries == m


# ------------------------------------------------------------------------------------------
# The one-run audit of a training run on Ray is tested on the killed-worker run of
# tests/pipelines/test_methods_on_ray.py (gradient canaries, restored from the checkpoint) and on the
# e2e run of tests/pipelines/test_sharded_training.py (black-box input canaries).
def test_one_run_audit_bad_input(tmp_path):
    from pipelines.config import TrainConfig
    from pipelines.plan import plan_run

    base = dict(storage_path=str(tmp_path / "runs"), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    with pytest.raises(dpcore.DPConfigError, match="do not fit.*9610 trainable parameters"):
        plan_run(TrainConfig(audit_canaries=20_000, **base))
    for rate in (0.0, 1.0, 1.5, -0.1, 0.3, 0.9):  # the bound holds at 1/2 only
        with pytest.raises(dpcore.DPConfigError, match="audit_canary_rate"):
            TrainConfig(audit_canaries=100, audit_canary_rate=rate, **base).validate()
    with pytest.raises(dpcore.DPConfigError, match="audit_guesses"):
        TrainConfig(audit_canaries=100, audit_guesses=101, **base).validate()
    with pytest.raises(dpcore.DPConfigError, match="audit_canaries"):
        TrainConfig(audit_canaries=-3, **base).validate()


def test_canary_gradients_are_within_the_clip_bound():
    model = torch.nn.Linear(5, 2)
    opt = dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model=model,
        loss_fn=torch.nn.functional.cross_entropy,
        noise_multiplier=1.0,
        clip_norm=0.5,
        sample_rate=0.1,
        dataset_size=100,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        add_noise=False,
        reduce_fn=lambda tensors: None,
    )
    with pytest.raises(dpcore.DPConfigError, match="exceeds clip_norm"):
        opt.add_coordinate_examples(torch.tensor([0]), 0.6)
    opt.add_coordinate_examples(torch.tensor([0, 11, 11]), 0.5)  # weight[0,0]; bias[1] twice
    opt.step()
    assert model.weight.grad[0, 0] == pytest.approx(0.5 / 10) and model.bias.grad[1] == pytest.approx(1.0 / 10)
    assert float(model.weight.grad.abs().sum() + model.bias.grad.abs().sum()) == pytest.approx(1.5 / 10)


def test_one_run_audit_of_a_federated_run(tmp_path):
    import mlflow

    from pipelines.federated import FederatedConfig, plan_federated, run_federated

    base = dict(
        executor="local",
        seed=0,
        rounds=30,
        noise_multiplier=1.0,
        target_delta=1e-4,
        eval_every=30,
        log_model=False,
        quiet=True,
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        storage_path=str(tmp_path / "runs"),
    )
    out = run_federated(FederatedConfig(audit_canaries=1000, audit_guesses=200, **base))
    a = out["audit"]
    assert 1.0 < a["epsilon_lower_bound"] <= out["epsilon"]
    assert a["scores"][a["membership"]].mean() > a["scores"][~a["membership"]].mean()
    r = mlflow.MlflowClient(out["tracking_uri"]).get_run(out["run_id"])
    assert (
        r.data.metrics["audit.epsilon_lower_bound"] == pytest.approx(a["epsilon_lower_bound"])
        and r.data.tags["dp.level"] == "client"
    )
    with pytest.raises(dpcore.DPConfigError, match="do not fit"):
        plan_federated(FederatedConfig(audit_canaries=10_000, **base))
    with pytest.raises(dpcore.DPConfigError, match="audit_canary_rate"):
        FederatedConfig(audit_canaries=10, audit_canary_rate=0.0, **base).validate()


@pytest.mark.parametrize("lower_bound, status", [(0.9, 0), (1.1, 3)], ids=["below", "above"])
def test_a_one_run_audit_above_epsilon_fails_the_command_that_ran_it(
    tmp_path, monkeypatch, capsys, lower_bound, status
):
    """`train` and `federated` with canaries exit 3 where ε_lb > ε, as `dp-platform audit` does,
    and say so on stderr (they exited 0, the failure one word of the summary); the line names
    the kind of canaries."""
    from pipelines import audit
    from pipelines.federated import cli as federated_cli
    from pipelines.federated import rounds
    from pipelines.train import cli as train_cli
    from pipelines.train import driver

    canaries = {
        "canaries": 1000,
        "guesses": 200,
        "correct": 160,
        "epsilon_lower_bound": lower_bound,
        "confidence": 0.95,
    }
    out = {"epsilon": 1.0, "audit": {**canaries, "kind": "input"}}
    lines = audit.one_run_audit_lines(out, "input canaries")
    assert lines[0] == (
        f"audit (one run, 1000 input canaries, 200 guesses): 160 correct -> ε_lb = {lower_bound:.3f} at 95% confidence "
        f"({'ABOVE' if status else '≤'} ε = 1.000)",
        False,
    )
    assert [to_stderr for _, to_stderr in lines[1:]] == ([True] if status else [])
    monkeypatch.setattr(driver, "run", lambda cfg, **kw: out)
    monkeypatch.setattr(train_cli, "print_summary", lambda o: None)
    storage = ["--storage-path", str(tmp_path / "runs"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]
    assert train_cli.main(["--quiet", *storage]) == status
    fed = {
        **dict.fromkeys(("run_id", "dataset", "registered_model"), ""),
        **dict.fromkeys(("num_clients", "clients_per_round", "rounds", "planned_rounds", "actor_restarts"), 1),
        **dict.fromkeys(("noise_multiplier", "update_noise_multiplier", "test_accuracy", "target_epsilon"), 1.0),
        **dict.fromkeys(("delta_at_target_epsilon", "target_delta", "comm_expected_bytes", "seconds"), 1.0),
        "seconds_rounds": 1.0,
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "epsilon": 1.0,
        "audit": canaries,
    }
    monkeypatch.setattr(rounds, "run_federated", lambda cfg: fed)
    capsys.readouterr()
    assert federated_cli.main(["--quiet", "--executor", "local", *storage]) == status
    printed = capsys.readouterr()
    assert "1000 canary clients" in printed.out and ("AUDIT FAILED: ε_lb > ε" in printed.err) == bool(status)
