"""dpcore/accountants/pld.py: PLDs built by the driver and handed to another process give that
process's ledger the same ε, bit for bit and equal to dp_accounting's, without building them again;
and the lazily imported dp_accounting (dpcore._lazy.LazyModule, as the accountants import it)
survives copy and pickle."""

import json

import dp_accounting
import pytest

import dpcore
from dpcore.accounting import GAUSSIAN, PrivacyEvent


def test_a_pld_handed_to_another_process_gives_its_ledger_the_same_epsilon_without_building_it(tmp_path):
    """The driver hands its workers the PLDs it built while planning (export_base_plds); a
    worker's ledger then records the same ε as dp_accounting, bit for bit the driver's, and
    builds nothing (here the construction raises)."""
    import pickle
    import subprocess
    import sys

    from dpcore.accountants.pld import export_base_plds

    step = dpcore.PrivacyEvent.dpsgd_step(0.7968, 0.0379)
    pca = PrivacyEvent(GAUSSIAN, 6.0, 1.0)  # a Gaussian event: composed directly, never handed
    handed = export_base_plds([pca, step])
    assert [e for e, _, _ in handed] == [step]
    (tmp_path / "plds.pkl").write_bytes(pickle.dumps(handed))
    here = [dpcore.epsilon([(step, 1)], 1e-5), dpcore.epsilon([(pca, 1), (step, 26)], 1e-5)]
    code = f"""
import json, pickle
import dp_accounting.pld.privacy_loss_distribution as built
import dpcore
from dpcore.accountants.pld import import_base_plds
from dpcore.accounting import GAUSSIAN, PrivacyEvent

def refuse(*args, **kwargs):
    raise AssertionError("built a subsampled PLD")

real = built.from_gaussian_mechanism
built.from_gaussian_mechanism = lambda *a, **k: refuse() if k.get("sampling_prob", 1.0) < 1 else real(*a, **k)
import_base_plds(pickle.load(open({str(tmp_path / "plds.pkl")!r}, "rb")))
step = dpcore.PrivacyEvent.dpsgd_step(0.7968, 0.0379)
ledger = dpcore.PrivacyLedger(3.0, 1e-5)
first = ledger.append(step, step=1, clip_norm=1.0, check_budget=False).epsilon
many = dpcore.epsilon([(PrivacyEvent(GAUSSIAN, 6.0, 1.0), 1), (step, 26)], 1e-5)
print(json.dumps([first, many]))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    there = json.loads(res.stdout.strip().splitlines()[-1])
    assert there == here
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.0379, dp_accounting.GaussianDpEvent(0.7968)), 1)
    assert there[0] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)


def test_the_lazily_imported_dp_accounting_survives_copy_and_pickle():
    """dpcore._lazy.LazyModule (helper-38: copy recursed, pickle refused the module)."""
    import copy
    import pickle

    from dpcore._lazy import LazyModule

    lazy = LazyModule("dp_accounting")
    for other in (copy.copy(lazy), copy.deepcopy(lazy), pickle.loads(pickle.dumps(lazy))):
        assert other.GaussianDpEvent(2.0) == lazy.GaussianDpEvent(2.0)
