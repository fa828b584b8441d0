"""The one release order (dpcore.release): check → noise once → reduce → ÷ size → record."""

import pytest
import torch

import dpcore
from dpcore.release import draw_noise, release


def _ledger(target=None):
    return dpcore.PrivacyLedger(target, 1e-5)


def test_release_runs_check_noise_reduce_divide_record_in_that_order():
    ledger = _ledger(8.0)
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.1)
    seen = []
    sums = [torch.ones(3), torch.full((2,), 2.0)]

    def noise():
        seen.append(("noise", len(ledger)))
        return [torch.full((3,), 10.0), torch.full((2,), 20.0)]

    def reduce_fn(ts):
        seen.append(("reduce", len(ledger), [t.clone() for t in ts]))
        for t in ts:
            t.mul_(2)  # stands for the SUM over two identical ranks

    out = release(
        sums, event=ev, ledger=ledger, noise=noise, reduce_fn=reduce_fn, expected_size=4.0, step=7, clip_norm=0.5
    )
    assert [s[0] for s in seen] == ["noise", "reduce"]
    assert seen[0][1] == 0 and seen[1][1] == 0  # nothing recorded before the noise and the reduce
    assert torch.equal(seen[1][2][0], torch.full((3,), 11.0))  # the reduce saw the noised sum
    assert torch.equal(out[0], torch.full((3,), 22.0 / 4)) and torch.equal(out[1], torch.full((2,), 44.0 / 4))
    assert torch.equal(sums[0], torch.full((3,), 22.0))  # the inputs keep the noised, reduced sum
    (entry,) = ledger.entries  # recorded once, after, at the step and C given
    assert entry.step == 7 and entry.clip_norm == 0.5 and entry.event == ev


def test_a_release_past_the_budget_draws_no_noise_reduces_nothing_and_records_nothing():
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.1)
    ledger = _ledger(0.5)
    fit = int(ledger.allowance(ev))
    for step in range(1, fit + 1):
        ledger.append(ev, step=step, clip_norm=1.0)
    calls = []
    sums = [torch.ones(4)]
    with pytest.raises(dpcore.BudgetExceededError):
        release(
            sums,
            event=ev,
            ledger=ledger,
            noise=lambda: calls.append("noise") or [torch.zeros(4)],
            reduce_fn=lambda ts: calls.append("reduce"),
            expected_size=2.0,
            step=fit + 1,
            clip_norm=1.0,
        )
    assert calls == [] and len(ledger) == fit and torch.equal(sums[0], torch.ones(4))


def test_a_rank_without_noise_releases_only_through_the_reduce():
    ledger = _ledger()
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.1)
    sums = [torch.ones(2)]
    out = release(
        sums,
        event=ev,
        ledger=ledger,
        noise=None,
        reduce_fn=lambda ts: ts[0].add_(5),
        expected_size=2.0,
        step=1,
        clip_norm=1.0,
    )
    assert torch.equal(out[0], torch.full((2,), 3.0)) and len(ledger) == 1


@pytest.mark.parametrize("secure", [True, False])
def test_draw_noise_gives_one_independent_draw_per_tensor_with_the_asked_std(secure):
    rng = dpcore.SecureRandomness() if secure else dpcore.SeededRandomness(3)
    like = [torch.zeros(200, 100), torch.zeros(30_000)]
    zs = draw_noise(rng, like, 2.5)
    assert [z.shape for z in zs] == [t.shape for t in like]
    flat = torch.cat([z.flatten() for z in zs]).double()
    n = flat.numel()  # 50,000 draws: the std's standard error is about 2.5/√(2n) ≈ 0.008
    assert abs(float(flat.std()) - 2.5) < 6 * 2.5 / (2 * n) ** 0.5
    assert abs(float(flat.mean())) < 6 * 2.5 / n**0.5
    assert not torch.equal(zs[0].flatten()[:100], zs[1][:100])  # not the same values twice


def _kernel_ops(fn) -> int:
    """ATen operations that reach a kernel while ``fn`` runs (views and allocations excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    free = {
        "view",
        "_unsafe_view",
        "as_strided",
        "detach",
        "alias",
        "empty",
        "empty_strided",
        "split",
        "split_with_sizes",
    }

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func._schema.name.split("::")[-1] not in free
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_a_release_of_many_tensors_takes_as_many_operations_as_a_release_of_two():
    """On a GPU each operation is a launch, and launches, not arithmetic, pace a private step at
    the batch sizes measured (docs/benchmarks/README.md): adding the noise and dividing by the
    expected size are multi-tensor operations, whatever the number of parameters."""
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.1)

    def ops(n):
        sums = [torch.ones(3 + k) for k in range(n)]
        noise = [torch.full((3 + k,), 0.5) for k in range(n)]
        out = []
        count = _kernel_ops(
            lambda: out.extend(
                release(sums, event=ev, ledger=_ledger(), noise=lambda: noise, expected_size=2.0, step=1, clip_norm=1.0)
            )
        )
        assert all(torch.equal(o, torch.full((3 + k,), 0.75)) for k, o in enumerate(out))
        return count

    assert ops(50) == ops(2) <= 2


def test_a_release_of_no_tensors_records_the_event_and_returns_none():
    ledger = _ledger()
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.1)
    assert release([], event=ev, ledger=ledger, noise=lambda: [], expected_size=2.0, step=1, clip_norm=1.0) == []
    assert len(ledger) == 1
