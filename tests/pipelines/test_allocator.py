"""pipelines.allocator: freed memory is kept for reuse, so steady-state private steps stop
taking page faults (measured by the kernel's own minor-fault count, in fresh processes)."""

import ast
import os
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys
warm, steps = 8, 15
from pipelines import allocator
applied = allocator.keep_freed_memory()
import torch
torch.set_num_threads(1)
from pipelines.ops.bench import MODELS, _data, _ours
make, shape, _ = MODELS["mnist_cnn"]
x, y = _data(shape, 256)
step, _ = _ours(make, x, y, "bookkeeping")
"""
# After the step is built: each of `steps` steps' minor and major faults, after `warm` warm-up
# steps.
MEASURE = r"""
for _ in range(warm):
    step()
faults = []
for _ in range(steps):
    before = resource.getrusage(resource.RUSAGE_SELF)
    step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    faults.append((after.ru_minflt - before.ru_minflt, after.ru_majflt - before.ru_majflt))
print(applied, faults)
"""
# With the setting, the heap grows to its steady size over the first steps, in a few bursts of
# fresh pages (0.5–8 MiB), and then nearly stops: measured 2026-11-25, 4 processes of 30 steps,
# the last burst at step 3, 5, 7 and 10, every other step 0 or 1 fault; 2026-12-07, 31
# processes of 40 steps, 0–6 bursts of 30–1,700 pages after step 3 (a burst every 12 steps on
# average), every other step 0 or 1 fault. So the median step is the measure. (Until
# book-keeping's first-batch check changed on 2026-11-25, it ran the whole first batch through
# vmap, which grew the heap in one step.) glibc's defaults fault 2,000–11,000 pages on every
# step of the same processes.
#
# A step with a major fault is left out of the median: the kernel evicted some of the process's
# own file pages (libtorch's code) under memory pressure and read them back, and the pages read
# ahead with them count as minor faults that no allocator setting causes. If fewer than half
# the steps are left, the process is not a measurement and is run again. (A CI run on
# 2026-12-07 failed once with a median of 147 faults beside other tests; that run printed no
# per-step counts, and 31 processes measured here alone, under CPU load and under memory
# pressure never came near it. The per-step counts are in the assertion's message now.)


def _median_undisturbed(faults):
    quiet = sorted(minor for minor, major in faults if major == 0)
    if 2 * len(quiet) < len(faults):
        return None
    return quiet[len(quiet) // 2]


def _run(child, env_extra, attempts=3):
    env = {**os.environ, "DP_NATIVE": "0", **env_extra}
    for _ in range(attempts):
        out = subprocess.run(
            [sys.executable, "-c", child + MEASURE], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        applied, faults = out.stdout.split(" ", 1)
        faults = ast.literal_eval(faults)
        median = _median_undisturbed(faults)
        if median is not None:
            return applied == "True", median, faults
    raise AssertionError(f"every attempt was disturbed by major faults (memory pressure): {faults}")


def _faults(env_extra):
    # The torch path of the per-example convolutions (grouped weight gradients) allocates and
    # frees large temporaries every step; the compiled kernel (dpcore.native) does not, and
    # faults nearly never either way. The allocator setting is for the torch path and for
    # models the kernel does not cover.
    return _run(CHILD, env_extra)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_kept_memory_removes_the_page_faults_of_a_private_step():
    tuned = []
    for _ in range(3):  # with the setting: nearly no fault, every time
        applied, faults, steps = _faults({})
        assert applied and faults < 50, (faults, steps)
        tuned.append(faults)
    # With glibc's defaults a private MNIST-CNN step (batch 256) faults in thousands of fresh
    # pages on most runs, but not all: glibc's dynamic mmap threshold sometimes settles where
    # the temporaries are reused (measured 2026-11-24 over 14 fresh processes: 0.2, 0.2, 43, 252
    # and ten runs of 1,400 to 7,147 per step). So the default is sampled until it faults, up to
    # 6 times (all six quiet by chance: about 1e-5).
    defaults = []
    for _ in range(6):
        off, faults, _ = _faults({"DP_MALLOC_TUNE": "0"})
        assert not off
        defaults.append(faults)
        if faults > 20 * max(max(tuned), 1.0):
            break
    assert max(defaults) > 20 * max(max(tuned), 1.0), (defaults, tuned)


LARGE_CHILD = r"""
import resource
from pipelines import allocator
applied = allocator.keep_freed_memory()
import torch
import torch.nn.functional as F
from torch import nn
import dpcore
from dpcore.layers import WSConv2d
torch.set_num_threads(1)
# One weight-standardised convolution whose per-example gradients (64 x 128 x 1152 floats,
# 38 MiB) are above glibc's largest mmap threshold (32 MiB), as ResNet-9's middle layers' are.
model = nn.Sequential(WSConv2d(128, 128, 3, padding=1, bias=False), nn.GroupNorm(16, 128), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
opt = dpcore.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model, loss_fn=F.cross_entropy,
                         noise_multiplier=1.0, clip_norm=1.0, sample_rate=0.01, dataset_size=6400,
                         randomness=dpcore.SecureRandomness(), ledger=dpcore.PrivacyLedger(None, 1e-5),
                         physical_batch_size=64, clipping="bookkeeping")
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 128, 16, 16, generator=g), torch.randint(0, 10, (64,), generator=g)
def step():
    opt.accumulate(x, y)
    opt.step()
warm, steps = 3, 6
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_blocks_above_the_largest_mmap_threshold_are_reused_too():
    # Blocks above 32 MiB came from mmap whatever the threshold (glibc's upper limit), and were
    # faulted in afresh at every step: here 18,434 pages (72 MiB) a step, measured
    # 2026-12-01. With mmap off for allocations, none after the first steps.
    applied, faults, steps = _run(LARGE_CHILD, {})
    assert applied
    assert faults < 50, (faults, steps)


CHECK_CHILD = r"""
import sys
from pipelines import allocator
assert allocator.keep_freed_memory()
import torch
import torch.nn.functional as F
from torch import nn
import dpcore
from dpcore import fastpath, memory
torch.set_num_threads(1)
if sys.argv[1] == "keep":  # the check's memory kept, as before return_freed
    fastpath.memory.return_freed = lambda device: None
def rss():
    return memory._read_status("VmRSS")
# A model whose first-batch check (a float64 copy of its 5.3M weights, their per-example float64
# gradients 2 examples at a time, float64 sums) takes more than its steps (ghost norms, no
# per-example gradients).
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
opt = dpcore.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model, loss_fn=F.cross_entropy,
                         noise_multiplier=1.0, clip_norm=1.0, sample_rate=0.01, dataset_size=6400,
                         randomness=dpcore.SeededRandomness(0), ledger=dpcore.PrivacyLedger(None, 1e-5),
                         physical_batch_size=64, clipping="auto")
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
before = rss()
opt.accumulate(x, y)  # the first batch: the check, then the batch's clipped sum
opt.step()
assert opt.clipping == "bookkeeping", opt.clipping
first_peak = memory._read_status("VmHWM")
after_first = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
for _ in range(3):
    opt.accumulate(x, y)
    opt.step()
steps_peak = memory._read_status("VmHWM")
print((first_peak - before) >> 20, (after_first - before) >> 20, (steps_peak - before) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_the_first_batch_checks_memory_is_given_back():
    # Book-keeping's first-batch check runs a float64 copy of the model and the vmap reference:
    # several times a step's memory. With the workers' allocator setting (freed memory kept), the
    # process held that peak for the whole run (all-MiniLM-L6-v2 at batch 16: 4,328 MiB during
    # the steps against 2,720 once it is given back, measured 2026-12-07).
    def run(mode):
        out = subprocess.run(
            [sys.executable, "-c", CHECK_CHILD, mode],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "DP_NATIVE": "0"},
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return [int(v) for v in out.stdout.split()]  # MiB over the start: first peak, after it, steps' peak

    first_peak, after_first, steps_peak = run("return")
    # Without it, the steps hold the check's peak.
    kept_peak, kept_after, kept_steps = run("keep")
    measured = (first_peak, after_first, steps_peak), (kept_peak, kept_after, kept_steps)
    # Measured 2026-12-07 (MiB over the start): given back, a peak of 492, 175 after the first
    # step and 236 in the steps; kept, 539, 538 and 538.
    assert first_peak > 300, measured  # the check did take its memory
    assert after_first < first_peak / 2 and steps_peak < 0.6 * kept_steps, measured
    assert kept_after > 0.8 * kept_peak and kept_steps > 0.8 * kept_peak, measured
