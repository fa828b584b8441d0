"""The one MLflow run lifecycle (pipelines.tracking.mlflow_run), on a real SQLite tracking store."""

import pytest

from pipelines import tracking


@pytest.fixture
def client(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracking.check_tracking_uri(uri)  # as the platform's commands do, then the database from the cached schema
    tracking.open_store(uri)
    return MlflowClient(uri)


def test_a_run_that_returns_is_finished_and_one_that_raises_is_failed_after_recording(client):
    with tracking.mlflow_run(client, experiment="e", run_name="ok", tags={"dp.level": "example"}) as ok:
        assert client.get_run(ok).info.status == "RUNNING"
    assert client.get_run(ok).info.status == "FINISHED" and client.get_run(ok).data.tags["dp.level"] == "example"
    recorded = []
    with pytest.raises(RuntimeError, match="boom"):
        with tracking.mlflow_run(client, experiment="e", run_name="bad", on_failure=recorded.append) as bad:
            raise RuntimeError("boom")
    assert recorded == [bad] and client.get_run(bad).info.status == "FAILED"


def test_a_failing_recorder_does_not_hide_the_error_and_the_run_is_still_failed(client):
    def broken(run_id):
        raise OSError("disk full")

    with pytest.raises(KeyError):
        with tracking.mlflow_run(client, experiment="e", on_failure=broken) as run_id:
            raise KeyError("the real error")
    assert client.get_run(run_id).info.status == "FAILED"


def test_children_nest_under_their_parent_and_a_found_or_given_run_is_continued(client):
    with tracking.mlflow_run(client, experiment="e", run_name="sweep-s", tags={"sweep.study": "s"}) as parent:
        with tracking.mlflow_run(client, experiment="e", parent_run_id=parent) as child:
            pass
    assert client.get_run(child).data.tags["mlflow.parentRunId"] == parent
    with tracking.mlflow_run(client, experiment="e", find="tags.`sweep.study` = 's'", tags={"n": "2"}) as again:
        assert again == parent and client.get_run(parent).info.status == "RUNNING"
    assert client.get_run(parent).data.tags["n"] == "2"
    with tracking.mlflow_run(client, experiment="e", run_id=child) as resumed:  # a resumed training run
        assert resumed == child
    assert client.get_run(child).info.status == "FINISHED"


def test_experiments_open_on_the_runs_table(client):
    """The experiment's kind says model training (for the API and UIs that read it; MLflow
    3.17's UI takes it from the link, which the browser tests check)."""
    exp_id = tracking.ensure_experiment(client, "fresh")
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
    old = client.create_experiment("older")  # made before the platform set the kind
    assert tracking.ensure_experiment(client, "older") == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    mine = client.create_experiment("mine", tags={"mlflow.experimentKind": "genai_development"})
    tracking.ensure_experiment(client, "mine")  # a kind someone chose is kept
    assert client.get_experiment(mine).tags["mlflow.experimentKind"] == "genai_development"
    with tracking.mlflow_run(client, experiment="via-run") as run_id:
        exp = client.get_experiment(client.get_run(run_id).info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_description_rounds_epsilon_and_the_full_value_stays(client):
    with tracking.mlflow_run(client, experiment="e", run_name="fmnist") as run_id:
        client.set_tag(run_id, "dp.epsilon", "1.994528386924076")
        tracking.describe_run(client, run_id, "fmnist", 1.994528386924076, 1e-5, "pld", 0.89687)
    run = client.get_run(run_id)
    tags = run.data.tags
    # rounded up (1.99 would read below the ledger's ε), the full value in dp.epsilon
    assert tags["mlflow.note.content"] == "**ε = 2.00** at δ = 1e-05 (pld) · test accuracy **89.69%**"
    assert tags["dp.epsilon_rounded"] == "2.00" and tags["dp.epsilon"] == "1.994528386924076"
    assert run.info.run_name == "ε=2.00 · 89.7% · fmnist"  # what the runs list shows first
    with tracking.mlflow_run(client, experiment="e", run_name="early") as run_id:
        tracking.describe_run(client, run_id, "early", 0.5, 1e-5, "rdp", float("nan"))  # no accuracy (stopped early)
    run = client.get_run(run_id)
    assert run.data.tags["mlflow.note.content"] == "**ε = 0.50** at δ = 1e-05 (rdp)"
    assert run.info.run_name == "ε=0.50 · early"


def test_ui_links_open_the_model_training_view():
    assert tracking.ui_link("http://h:5000/", "3") == "http://h:5000/#/experiments/3?workflowType=machine_learning"
    assert (
        tracking.ui_link("http://h:5000", "3", "abc")
        == "http://h:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )


def test_a_run_is_found_by_its_id_or_the_first_characters_of_it(client):
    """`dp-platform ledger` takes the 8 characters the MLflow UI shows; a prefix that several runs
    share, or none, is refused with the reason."""
    from collections import Counter

    from pipelines.cli import find_run

    ids = [client.create_run(client.create_experiment(f"e{i % 2}") if i < 2 else "1").info.run_id for i in range(40)]
    for run_id in (ids[0], ids[1][:8], ids[2][:8].upper()):
        assert find_run(client, run_id).info.run_id.startswith(run_id.lower())
    client.delete_run(ids[3])  # a deleted run's ledger is still the run's: found too
    assert find_run(client, ids[3][:8]).info.run_id == ids[3]
    shared = next(c for c, n in Counter(i[0] for i in ids).items() if n > 1)  # 40 ids, 16 first digits
    with pytest.raises(LookupError, match=f"several runs start with '{shared}'"):
        find_run(client, shared)
    with pytest.raises(LookupError, match="no run id starts with 'zzzzzzzz'"):  # not hex: no run's id
        find_run(client, "zzzzzzzz")
    with pytest.raises(LookupError):
        find_run(client, "' OR 1=1 --")  # not an id: not put in a filter


def test_the_ledger_command_explains_a_blank_epsilon(client, capsys):
    """ε is composed only when asked: the rows in between are blank, and the command says why."""
    import dpcore
    from pipelines.cli import main

    ledger = dpcore.PrivacyLedger(3.0, 1e-5, "pld")  # ε on the first entry of a kind, then when asked
    event = dpcore.PrivacyEvent.of(dpcore.events.POISSON_GAUSSIAN, 1.1, 0.01)
    for step in range(1, 4):
        ledger.append(event, step, clip_norm=1.0)
    ledger.epsilon()  # fills the last entry
    run_id = client.create_run(client.create_experiment("ledger")).info.run_id
    tracking.log_ledger(client, run_id, ledger)
    assert main(["ledger", run_id[:8], "--tracking-uri", client.tracking_uri]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "committed" in line and "poisson_gaussian" in line]
    assert len(rows) == 3 and rows[1].rstrip().endswith("committed")  # step 2's ε: blank
    assert "(a blank ε: not composed at that release; the budget check before it was exact." in out


def test_the_runs_name_and_description_round_epsilon_up(client):
    run_id = client.create_run(client.create_experiment("shown")).info.run_id
    tracking.describe_run(client, run_id, "digits-mlp", 1.00499, 1e-5, "pld", 0.9312)
    run = client.get_run(run_id)
    assert run.info.run_name.startswith("ε=1.01 · 93.1%") and run.data.tags["dp.epsilon_rounded"] == "1.01"
    assert run.data.tags["mlflow.note.content"].startswith("**ε = 1.01** at δ = 1e-05")


def test_the_runs_tags_say_its_randomness_accountant_and_diagnostics_as_configured():
    """Invariants 6, 7 and 9 as MLflow shows them (helper-32: no fast test read these tags)."""
    import types

    from pipelines.config import TrainConfig

    plan = types.SimpleNamespace(
        noise_multiplier=1.1, sample_rate=0.01, run_dir="/r", ray_run_name="r", dataset_size=10**4
    )
    plain = tracking.dp_tags(TrainConfig(), plan)
    assert TrainConfig().accountant == "pld" and plain["dp.accountant"] == "pld"  # the tight accountant by default
    assert plain["dp.randomness"] == "secure" and "dp.diagnostics" not in plain
    seeded = tracking.dp_tags(TrainConfig(seed=3, diagnostics=True, accountant="rdp"), plan)
    assert seeded["dp.randomness"] == "seeded (seed=3; not for production)"
    assert seeded["dp.diagnostics"] == "non-private" and seeded["dp.accountant"] == "rdp"


def test_a_failing_search_for_a_run_is_said_not_raised(client, monkeypatch):
    """An id prefix whose search fails (an unreachable or refusing server) is reported as such
    (helper-35: the exception left as a traceback)."""
    import mlflow

    from pipelines.cli import find_run

    def refuse(*a, **k):
        raise mlflow.exceptions.MlflowException("permission denied")

    monkeypatch.setattr(client, "search_experiments", refuse)
    with pytest.raises(
        LookupError, match="searching for runs that start with 'abcd1234' failed too: permission denied"
    ):
        find_run(client, "abcd1234")
