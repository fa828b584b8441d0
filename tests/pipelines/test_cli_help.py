"""The command line answers at once: ``dp-platform [CMD] --help`` builds its help without
importing torch, Ray, MLflow, Optuna, pyarrow or scikit-learn (K, must-show 5). The times are
measured by docs/benchmarks/cli_help.sh (a table, not a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

COMMANDS = ["", "train", "sweep", "federated", "audit", "ingest", "ledger", "ui", "bench", "stack", "submit"]
COMMANDS += ["status", "logs", "stop", "clean"]
HEAVY = ("torch", "ray", "mlflow", "optuna", "pyarrow", "sklearn", "scipy", "dp_accounting", "numpy")

PROBE = """
import json, sys
from pipelines.cli import main
argv = sys.argv[1:]
try:
    code = main(argv)
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": sorted(m for m in HEAVY if m in sys.modules)}))
""".replace("HEAVY", repr(HEAVY))


@pytest.mark.parametrize("command", COMMANDS, ids=[c or "top" for c in COMMANDS])
def test_help_imports_nothing_heavy(command):
    argv = [command, "--help"] if command else ["--help"]
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    *help_lines, last = out.stdout.strip().splitlines()
    result = json.loads(last)
    assert result["code"] in (0, None)
    assert result["heavy"] == [], f"`dp-platform {command} --help` imported {result['heavy']}"
    assert len(help_lines) > 5  # a real help text
    text = "\n".join(help_lines)
    for markup in ("`", ":mod:", ":func:", ":class:", ":data:", "(default: None)"):
        assert markup not in text, f"`dp-platform {command} --help` shows {markup!r}"


def test_the_version_answers_without_heavy_imports():
    out = subprocess.run([sys.executable, "-c", PROBE, "--version"], capture_output=True, text=True, timeout=60)
    first, last = out.stdout.strip().splitlines()
    assert first.startswith("dp-platform ") and json.loads(last) == {"code": 0, "heavy": []}


def test_import_dpcore_is_lazy_and_complete():
    """``import dpcore`` loads no torch; every exported name still resolves, to the same object
    as its home module's."""
    code = """
import importlib, sys
import dpcore
assert "torch" not in sys.modules
from dpcore import DPConfigError
assert "torch" not in sys.modules
for name in dpcore.__all__:
    value = getattr(dpcore, name)
    home = dpcore._EXPORTS.get(name)
    if home is not None:
        assert value is getattr(importlib.import_module("dpcore." + home), name), name
assert sorted(dpcore.__all__) == sorted(set(dpcore._EXPORTS) | set(dpcore._SUBMODULES))
try:
    dpcore.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("no AttributeError")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_catalog_names_what_the_modules_implement():
    from pipelines import catalog
    from pipelines.audit import mechanisms
    from pipelines.data import sources
    from pipelines.ops import bench, bench_cli

    assert tuple(bench.MODELS) == bench_cli.BENCH_MODELS
    assert mechanisms.MECHANISMS == catalog.AUDIT_MECHANISMS
    for name in catalog.DATASETS:  # every listed dataset has a loader (an unknown one is refused)
        assert name in sources.DATASETS
    from pipelines.models import MODEL_BUILDERS

    assert {m for m in catalog.MODELS if ":" not in m} == set(MODEL_BUILDERS)  # tv:, hf: are prefixes


def test_a_reader_that_leaves_early_gets_no_traceback(monkeypatch):
    """`dp-platform ledger RUN | head`: when the pipe's reader leaves, the command ends with
    status 1 and no BrokenPipeError traceback (helper-28 saw one)."""
    import io
    import os

    from pipelines import cli

    def writes_into_a_closed_pipe(argv):
        raise BrokenPipeError(32, "Broken pipe")

    read, write = os.pipe()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(os.fdopen(write, "wb")))
    monkeypatch.setattr(cli, "_ledger", writes_into_a_closed_pipe)
    os.close(read)
    assert cli.main(["ledger", "0123"]) == 1


@pytest.mark.parametrize(
    "argv, meant",
    [
        (["train", "--target-epsilom", "3"], "--target-epsilon"),
        (["sweep", "--n-trail", "3"], "--n-trials"),
        (["clean", "--dryrun"], "--dry-run"),
        (["federated", "--local-rl=0.1"], "--local-lr"),
        (["stack", "up", "--dirr", "x"], "--dir"),  # a subcommand's flag (helper-35)
    ],
)
def test_a_misspelled_flag_is_answered_with_the_flag_meant(argv, meant, capsys):
    from pipelines.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    wrong = next(a for a in argv if a.startswith("--")).split("=")[0]
    assert f"unrecognized arguments: {wrong}" in err
    assert f"{wrong}: did you mean {meant}" in err


def test_a_misspelled_config_key_is_answered_with_the_key_meant(tmp_path):
    import dpcore
    from pipelines.config import load_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("epoch: 3\n")  # shares no first word with epochs: found by its spelling
    with pytest.raises(dpcore.DPConfigError, match="unknown config key 'epoch'. Did you mean epochs\\?"):
        load_config(bad)
