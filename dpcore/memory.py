"""Pick the physical batch size from a memory budget, by measurement.

The physical batch size bounds the memory of the per-example gradient computation and changes
nothing in the privacy analysis (the lot is still summed in full before noise). Its memory
grows about linearly with the batch: a fixed part (weights, workspaces) plus a part per
example (activations, output gradients, materialised per-example gradients). Two probes of
the clipped-sum computation measure both, and the largest power of two that fits the budget
is taken.

The fit is a straight line through two small probes; where a layer switches form with the
batch (book-keeping's ghost norms above its materialisation budget) the line is an
estimate, hence the safety factor. So the size it picks is then measured too, and halved
until its measured peak fits the budget: a layer whose ghost form at the picked size needs
more memory per example than the materialised form the small probes ran is caught there.

Peak memory of a probe:
* CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak statistics.
* CPU (Linux): the process's resident-set high-water mark (``VmHWM``), reset through
  ``/proc/self/clear_refs`` after ``malloc_trim(0)`` has returned free heap memory, so that
  memory kept by the allocator from earlier steps is not counted as available.

The probes run the real computation on real examples but release nothing: their sums are
thrown away, and neither the ledger, the lot nor any randomness is touched.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from .errors import DPConfigError

PROBE_BATCHES = (4, 16)
SAFETY = 1.15  # per-example bytes are scaled up by this much before fitting


def _read_kib(path: str, key: str) -> int:
    """A ``key: N kB`` line of a /proc file, in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in {path}")


def _read_status(key: str) -> int:
    return _read_kib("/proc/self/status", key)


def cpu_peak_supported() -> bool:
    try:
        _read_status("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def return_freed(device: torch.device) -> None:
    """Give the memory freed so far back to the system: glibc's free heap pages on a CPU
    (``malloc_trim(0)``; a no-op elsewhere), the caching allocator's unused blocks on a GPU. For
    one-off work much larger than a step (book-keeping's first-batch check, on a float64 copy of
    the model): where the allocator keeps freed memory (``pipelines.allocator``, as the
    workers set it), the process would otherwise hold that work's peak for the whole run."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    if not sys.platform.startswith("linux"):  # (ctypes.CDLL(None) raises TypeError on Windows)
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (musl has no malloc_trim)
        pass


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak memory that ``fn()`` adds over what was in use before it, in bytes."""
    if device.type == "cuda":  # reserved, not allocated: the caching allocator's blocks count
        torch.cuda.synchronize(device)
        return_freed(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_reserved(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_reserved(device) - base)
    return_freed(device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _read_status("VmRSS")
    fn()
    return max(0, _read_status("VmHWM") - base)


AUTO_CPU_FRACTION = 0.5  # of a worker's share of its node's memory
AUTO_GPU_FRACTION = 0.6  # of its GPU's memory


# A container's memory limit, as its own cgroup namespace shows it (v2, then v1); v1's "no
# limit" is a huge number, which MemTotal then undercuts.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def node_memory_bytes() -> int:
    """This process's memory limit: the node's RAM (``MemTotal``), or its cgroup's limit
    (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``) where that is lower (a container, a
    Kubernetes pod)."""
    total = _read_meminfo("MemTotal")
    for path in CGROUP_LIMITS:
        try:
            limit = Path(path).read_text().strip()
            if limit != "max":
                total = min(total, int(limit))
        except (OSError, ValueError):
            pass
    return total


def _read_meminfo(key: str) -> int:
    return _read_kib("/proc/meminfo", key)


def auto_budget_bytes(device: torch.device, share: float) -> int | None:
    """The budget ``memory_budget_mb: auto`` gives one worker: on a GPU, 60 % of its memory; on
    the CPU, half of its ``share`` (a fraction) of the node's memory. The rest is for the
    weights, the optimizer's state, the data and the libraries. None where the memory cannot be
    read (then no budget applies)."""
    if device.type == "cuda":
        return int(AUTO_GPU_FRACTION * torch.cuda.get_device_properties(device).total_memory)
    if not 0 < share <= 1:
        raise ValueError(f"a worker's share of its node is in (0, 1], not {share}")
    try:
        total = node_memory_bytes()
    except OSError:
        return None
    return int(AUTO_CPU_FRACTION * total * share)


def fit_batch_size(
    probe: Callable[[int], object], upper: int, budget_bytes: int, device: torch.device, at_least_one: bool = False
) -> dict:
    """The largest power of two ≤ ``upper`` whose peak fits ``budget_bytes`` (``upper`` itself
    if it fits), by a line through two probes; a size above the probes is then measured, and
    the next power of two below taken while its measured peak does not fit (each measurement
    in ``report["checked_peaks"]``, None where a GPU ran out of memory). ``probe(b)`` runs the
    computation on b examples. Where not even one example fits: an error, or with
    ``at_least_one`` 1 (``report["over_budget"]``)."""
    if budget_bytes <= 0:
        raise DPConfigError(f"the memory budget must be positive, not {budget_bytes} bytes.")
    b1, b2 = (min(upper, b) for b in PROBE_BATCHES)
    if device.type != "cuda" and not cpu_peak_supported():
        return {"physical_batch_size": upper, "measured": False, "reason": "no /proc/self peak-memory interface"}
    probe(b2)  # warm-up: lazy initialisation and kernel caches are not per-example memory
    p1 = peak_bytes(lambda: probe(b1), device)
    p2 = peak_bytes(lambda: probe(b2), device)
    # (If noise makes the larger probe look no bigger, the whole peak is charged per example.)
    per_example = (p2 - p1) / (b2 - b1) if (b2 > b1 and p2 > p1) else max(p2 / b2, 1.0)
    fixed = max(p1 - per_example * b1, 0.0)
    fits = math.floor((budget_bytes - fixed) / (per_example * SAFETY))
    report = {
        "measured": True,
        "per_example_bytes": per_example,
        "fixed_bytes": fixed,
        "budget_bytes": budget_bytes,
        "probe_peaks": {b1: p1, b2: p2},
    }
    if fits < 1 and at_least_one:
        report.update(physical_batch_size=1, over_budget=True)
        return report
    if fits < 1:
        raise DPConfigError(
            f"the memory budget of {budget_bytes / 2**20:.0f} MiB does not fit one example: measured "
            f"{per_example / 2**20:.1f} MiB per example plus {fixed / 2**20:.0f} MiB fixed. Raise the budget."
        )
    chosen = upper if fits >= upper else 2 ** int(math.log2(fits))
    # The line is an estimate beyond the probes: measure the choice, halving until it fits.
    while chosen > b2:
        peak = _peak_or_none(lambda b=chosen: probe(b), device)
        report.setdefault("checked_peaks", {})[chosen] = peak
        if peak is not None and peak <= budget_bytes:
            break
        chosen = 1 << ((chosen - 1).bit_length() - 1)  # the next power of two below
    report["physical_batch_size"] = chosen
    return report


def _peak_or_none(fn: Callable[[], object], device: torch.device) -> int | None:
    """:func:`peak_bytes`, or None where the device ran out of memory (a GPU's allocator
    raises; the caller then takes a smaller size)."""
    try:
        return peak_bytes(fn, device)
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def fit_optimizer(opt, x: torch.Tensor, y: torch.Tensor, budget_bytes: int, at_least_one: bool = False) -> dict:
    """Set ``opt.physical_batch_size`` (a :class:`dpcore.DPOptimizer`) to the largest power of
    two, at most its current value, whose measured peak memory fits ``budget_bytes``.

    The probes run the optimizer's own per-example path (BAM's ascent, DP-SAT's diagnostics
    pair, and, before book-keeping is verified, both book-keeping and vmap) on batches shaped
    like ``x``; their sums are thrown away, nothing is released, sampled or ledgered, and the
    augmentation stream is put back. Only the shapes and dtypes of ``x`` and ``y`` are used: the
    probes run on random inputs and zero targets of those shapes, so the measured sizes (which
    the pipeline logs) are not a statistic of the training data. Returns the measurement report.
    """
    from . import bookkeeping
    from .clipping import clipped_sum

    upper = opt.physical_batch_size
    if len(x) == 0:
        return {"physical_batch_size": upper, "measured": False, "reason": "no examples to probe with"}
    need = upper  # the probes' sizes, then the picked size itself
    g = torch.Generator().manual_seed(0)
    shape = (need, *x.shape[1:])
    if x.is_floating_point():
        x = torch.randn(shape, generator=g, dtype=x.dtype).to(x.device)
    else:
        x = torch.zeros(shape, dtype=x.dtype, device=x.device)
    y = torch.zeros((need, *y.shape[1:]), dtype=y.dtype, device=y.device)
    fast = opt.lot.fast if opt.lot.fast is not None and opt.lot.fast.active else None
    method = opt.method.name
    # Sums like the lot's (float64), made before the probes: a probe adds its batch into them as
    # training does, so the batch's float64 sums are in the peak and the lot's are not.
    sink = {n: torch.zeros_like(s) for n, s in opt.lot.sums.items()}

    def probe(b: int):
        xb, yb = x[:b], y[:b]
        if opt.augment is not None:
            xb = opt.lot.augmented(xb)
        if fast is not None:
            try:
                fast.clipper.clipped_sum(xb, yb, opt.clip_norm, sink)
            except bookkeeping.Unsupported:
                pass
        if fast is None or not fast.verified:
            alive = []  # per-example sets that training holds at the same time
            if method == "bam":  # the ascent's memory, whatever λ is at step 0
                per_sample, at_theta = opt.grad_sampler.bam(xb, yb, 1.0, opt.method.bam_variant)
                alive.append(at_theta)
            else:
                per_sample = opt.grad_sampler(xb, yb)
                if method == "dpsat" and opt.diagnostics_enabled:  # a second set, at θ
                    alive.append(opt.grad_sampler(xb, yb))
            clipped_sum(per_sample, opt.clip_norm, out=sink, ord=opt.norm_ord)
            alive.clear()

    augment = opt.augment
    saved = augment.state_dict() if augment is not None and hasattr(augment, "state_dict") else None
    try:
        device = next(iter(opt.params.values())).device
        report = fit_batch_size(probe, upper, int(budget_bytes), device, at_least_one)
    finally:
        if saved is not None:
            augment.load_state_dict(saved)
    if report["physical_batch_size"] < upper:
        opt.physical_batch_size = report["physical_batch_size"]
    report["physical_batch_size"] = opt.physical_batch_size
    return report
