"""Issue E: DP-FedAvg when things go wrong (pipelines/federated/): a killed client actor is
replaced and its share redone, so that the round neither loses nor duplicates a client's update (the
very model of the same run in one process); and bad input is refused with a clear error before any
round: configs that cannot run or would hold no guarantee, client actors that the Ray cluster cannot
hold, a client with no data."""

import pytest
import torch

import dpcore
from pipelines.federated import ActorFault, plan_federated, run_federated
from pipelines.federated.clients import split_clients

from ._common import DIGITS, _cfg


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
