"""The one MLflow run lifecycle (pipelines.tracking.mlflow_run), on a real SQLite tracking store."""

import pytest

from pipelines import tracking


@pytest.fixture
def client(tmp_path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")


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
