"""Bad input gets an error that names the value and the fix, before any step is taken."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import dpcore

from ..helpers import tiny_mlp

GOOD = dict(dataset_size=1000, lot_size=100, epochs=2, target_epsilon=2.0, target_delta=1e-5, clip_norm=1.0)


def _make(**over):
    torch.manual_seed(0)
    model = tiny_mlp()
    params = {**GOOD, **over}
    return dpcore.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, seed=0, **params)


@pytest.mark.parametrize(
    "over, pattern",
    [
        (dict(target_epsilon=0.0), r"target_epsilon=0.0 is invalid: ε must be a finite number > 0"),
        (dict(target_epsilon=-1.0), r"target_epsilon=-1.0 is invalid"),
        (dict(target_epsilon=float("inf")), r"target_epsilon=inf is invalid"),
        (dict(target_delta=0.0), r"target_delta=0.0 is invalid: δ must lie strictly between 0 and 1"),
        (dict(target_delta=1.0), r"target_delta=1.0 is invalid"),
        (dict(target_delta=-0.1), r"target_delta=-0.1 is invalid"),
        (dict(clip_norm=0.0), r"clip_norm=0.0 is invalid: .* C must be a finite number > 0"),
        (dict(clip_norm=-2.0), r"clip_norm=-2.0 is invalid"),
        (dict(lot_size=1001), r"lot_size=1001 is larger than the dataset \(N=1000\).*choose lot_size ≤ 1000"),
        (dict(lot_size=0), r"lot_size=0 is invalid"),
        (dict(dataset_size=0), r"dataset_size=0 is invalid: the dataset is empty"),
        (dict(epochs=0), r"epochs=0 is invalid"),
        (dict(noise_multiplier=0.0), r"noise_multiplier=0.0 is invalid: .*σ=0 releases gradients without privacy"),
        (dict(noise_multiplier=0.3, target_epsilon=1.0), r"noise_multiplier=0.3 cannot take even one step"),
        (dict(accountant="gdp"), r"accountant='gdp' is unknown"),
    ],
)
def test_bad_run_parameters_are_rejected_with_value_and_fix(over, pattern):
    with pytest.raises(dpcore.DPConfigError, match=pattern):
        _make(**over)


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan")])
def test_sample_rate_outside_unit_interval_is_rejected(q):
    with pytest.raises(
        dpcore.DPConfigError, match=r"sample_rate=.* is invalid: the Poisson sample rate q must lie in \(0, 1\]"
    ):
        dpcore.PoissonSampler(100, q, dpcore.SeededRandomness(0), steps=1)
    with pytest.raises(dpcore.DPConfigError, match="sample_rate"):
        dpcore.calibrate_noise_multiplier(1.0, 1e-5, q, 10)


def test_sample_rate_of_one_is_allowed():
    sampler = dpcore.PoissonSampler(10, 1.0, dpcore.SeededRandomness(0), steps=1)
    assert len(sampler.sample()) == 10


def test_delta_at_least_one_over_n_gets_a_loud_warning():
    with pytest.warns(dpcore.DeltaTooLargeWarning, match=r"1/N.*weak"):
        _make(dataset_size=1000, target_delta=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dpcore.DeltaTooLargeWarning)
        _make(dataset_size=1000, target_delta=1e-5)  # no warning


def test_unreachable_target_is_an_error_before_training():
    # With σ calibrated, any ε>0 is reachable; with a fixed σ too small, it is not.
    with pytest.raises(dpcore.DPConfigError, match="cannot take even one step"):
        dpcore.plan(
            dataset_size=100, lot_size=100, epochs=1, target_epsilon=0.01, target_delta=1e-5, noise_multiplier=0.5
        )


def _refused_with_a_journal(tmp_path, match: str, **options) -> None:
    """make_private with a journal is refused (``match``) before the journal is written."""
    journal = tmp_path / "ledger.jsonl"
    torch.manual_seed(0)
    model = tiny_mlp()
    with pytest.raises(dpcore.DPConfigError, match=match):
        dpcore.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            F.cross_entropy,
            seed=0,
            journal=str(journal),
            **{**GOOD, **options},
        )
    assert not journal.exists()


def test_a_bad_config_spends_nothing_even_with_a_journal(tmp_path):
    # The failure comes before the ledger (and its journal) exist: nothing is recorded.
    _refused_with_a_journal(tmp_path, "lot_size=5000", lot_size=5000)


def test_only_rank_0_keeps_the_journal(tmp_path):
    """Every rank records the same releases: ranks sharing one journal would count each release
    once per rank (a restart would then read twice the ε). A journal on a rank ≥ 1 is refused
    before anything is written."""
    _refused_with_a_journal(
        tmp_path, "only rank 0 keeps the ledger's journal", rank=1, world_size=2, reduce_fn=lambda tensors: tensors
    )


class _Tokens(torch.nn.Module):
    """Embedding, then a Linear over the positions, mean-pooled: the shape of a text classifier."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 6)
        self.proj = torch.nn.Linear(6, 3)

    def forward(self, ids):
        return self.proj(self.embed(ids)).mean(dim=1)


@pytest.mark.parametrize("clipping", ["vmap", "bookkeeping"])
def test_an_example_shape_that_changes_between_batches_is_refused(clipping):
    """A loader that pads each batch to its longest sequence lets one example change the others'
    inputs (and, on the book-keeping path, the layer forms that round their shares): a second
    batch whose examples have another shape is refused, the lot is dropped, nothing is spent."""
    torch.manual_seed(0)
    model = _Tokens()
    private = dpcore.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, seed=0, clipping=clipping, **GOOD
    )
    opt = private.optimizer
    ids, labels = torch.randint(0, 20, (8, 12)), torch.randint(0, 3, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)
        opt.accumulate(ids, labels)
        opt.step()
        opt.accumulate(ids[:4], labels[:4])  # the same shape in a smaller batch: fine
        before = [p.detach().clone() for p in model.parameters()]
        spent = private.ledger.epsilon()
        with pytest.raises(dpcore.DPConfigError, match=r"example's input shape changed.*fixed shape") as err:
            opt.accumulate(torch.randint(0, 20, (4, 17)), labels[:4])
    # Neither shape is shown: padded to a batch's longest, both depend on the data.
    assert "17" not in str(err.value) and "12" not in str(err.value)
    assert opt.clipping == clipping
    assert not opt.lot.open and opt.lot.examples == 0  # the lot was dropped whole
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert private.ledger.epsilon() == spent
    # The shape is part of the optimizer's state: a run resumed from a checkpoint keeps it.
    resumed = dpcore.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, seed=0, clipping=clipping, **GOOD
    ).optimizer
    resumed.load_state_dict(opt.state_dict())
    with warnings.catch_warnings(), pytest.raises(dpcore.DPConfigError, match="first batch's"):
        warnings.simplefilter("ignore", dpcore.SeededRandomnessWarning)
        resumed.accumulate(torch.randint(0, 20, (4, 17)), labels[:4])
