"""Issue E: the DP-FedAvg mechanism (pipelines/federated/, dpcore/federated.py), checked against
independent references: each client's update is clipped to norm S and does not depend on the clients
before it; the non-IID split covers every example once; clients are Poisson-sampled, their count
Binomial(K, m/K) (scipy); the server adds its noise once per round with std z·S, on one process or on
two Ray actors; its update equals a replay of the seeded sampling and noise streams, with fixed and
adaptive clipping; and adaptive clipping's two noises compose to one Gaussian of z (dp_accounting)."""

import math

import dp_accounting
import numpy as np
import pytest
import torch
from scipy import stats

import dpcore
from dpcore.clipping import CLIP_MARGIN
from dpcore.federated import AdaptiveClipping, ClientLevelDP, clip_update, split_noise_multiplier
from pipelines.federated import run_federated
from pipelines.federated.clients import split_clients

from ._common import DIGITS, _cfg, _initial_weights, _runner


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
