"""The main job as a user runs it: a subprocess, flags, output and exit codes."""
import re
import subprocess
import sys

import pytest


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "pipelines.train", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_main_job_trains_on_digits_and_prints_accuracy_and_epsilon():
    res = _run("--epochs", "10", "--target-epsilon", "4")
    assert res.returncode == 0, res.stderr
    acc = float(re.search(r"test accuracy: ([0-9.]+)", res.stdout).group(1))
    eps = float(re.search(r"ε spent: ([0-9.]+) at δ=1e-05", res.stdout).group(1))
    assert 0.0 < eps <= 4.0
    assert acc > 0.6  # 10 classes: chance is 0.1
    assert "randomness=secure" in res.stdout
    assert "step" in res.stderr  # progress: steps, ε, ETA
    assert "ETA" in res.stderr


def test_help_explains_every_option():
    res = _run("--help")
    assert res.returncode == 0
    for flag in ("--target-epsilon", "--target-delta", "--lot-size", "--clip-norm", "--noise-multiplier", "--accountant", "--seed"):
        assert flag in res.stdout
    assert "secure mode" in res.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lot-size", "100000"], "lot_size=100000 is larger than the dataset"),
        (["--target-epsilon", "-1"], "target_epsilon=-1.0 is invalid"),
        (["--dataset", "nope"], "dataset='nope' is unknown"),
        (["--target-delta", "2"], "target_delta=2.0 is invalid"),
    ],
)
def test_bad_flags_fail_fast_with_a_clear_message(args, message):
    res = _run(*args, "--quiet", timeout=120)
    assert res.returncode == 2
    assert message in res.stderr
    assert "test accuracy" not in res.stdout
