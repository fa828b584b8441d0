"""The start-up benchmark's CPU accounting (docs/benchmarks/fashion_mnist.py startup), whose
numbers docs/fashion-mnist.md uses to say why ≤ 10 s through Ray cannot be had on 2 cores: it
counts the launched process and every process below it, by group, and stops counting at the
first step."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import subprocess, sys, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
GRANDCHILD = "import time\\nend = time.process_time() + 0.8\\nwhile time.process_time() < end: pass\\ntime.sleep(0.5)"
grandchild = subprocess.Popen([sys.executable, "-c", GRANDCHILD])
burn(0.4)
grandchild.wait()
open(sys.argv[1], "a").write("1.0 1 first step done\\n")
burn(1.5)  # after the first step: not counted
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_cpu_is_counted_for_the_process_tree_until_the_first_step(tmp_path):
    spec = importlib.util.spec_from_file_location("fashion_mnist_bench", ROOT / "docs/benchmarks/fashion_mnist.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    trace = tmp_path / "trace.txt"
    t0 = time.time()
    with subprocess.Popen([sys.executable, "-c", CHILD, str(trace)]) as proc:
        cpu = bench.cpu_until_first_step(proc, trace)
    assert proc.returncode == 0 and time.time() - t0 > 1.5  # it waited for the run's end
    # the grandchild's 0.8 s (a process below the launched one), sampled every 0.1 s
    assert 0.6 <= cpu["Ray's own processes"] <= 1.0
    # the launched process: 0.4 s and its start, not the 1.5 s after the first step
    assert 0.3 <= cpu["driver"] <= 1.0
    assert cpu["Ray Train worker"] == cpu["Ray Train sync actor"] == 0.0
    assert cpu["total"] == pytest.approx(sum(cpu[g] for g in bench.CPU_GROUPS))
