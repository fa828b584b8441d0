"""The run's model in MLflow: logged (a torch.export graph, or a text classifier's pyfunc) and
registered, with ε and δ on the model version."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dpcore.readout import epsilon_text

if TYPE_CHECKING:
    import numpy as np


def log_model(
    run_id: str,
    model,
    example: np.ndarray,
    registered_name: str | None,
    epsilon: float,
    delta: float,
    accountant: str,
    text: dict | None = None,
    selection: str | None = None,
    no_guarantee: str | None = None,
    version_tags: dict | None = None,
):
    """Log the model (signature + input example) in ``run_id`` and register it; ε and δ go on
    the model version (and ``selection``, for a sweep's best model: what ε covers of the
    choice among trials, in the version's tag ``dp.selection`` and its description). A model
    trained without a guarantee (``no_guarantee``: why) has no ε: its model and version say
    ``dp.epsilon=none`` and carry the reason in ``dp.guarantee`` and the description.
    ``version_tags``: more tags for the registered version. A text
    classifier (``text``: its :func:`pipelines.text.logged.text_meta`) is logged as a pyfunc of
    texts: its LoRA adapter (or all weights), base model's name and tokenizer. Returns the
    ModelVersion (or None when not registered)."""
    import mlflow
    import torch
    from mlflow.models import infer_signature

    tags = {"dp.epsilon": epsilon_text(epsilon), "dp.delta": f"{delta:g}"}
    if no_guarantee:
        tags = {"dp.epsilon": "none", "dp.guarantee": no_guarantee}
    with mlflow.start_run(run_id=run_id):
        if text is not None:
            from ..text.logged import log_text_model

            info = log_text_model(model, text, tags)
        else:
            model.eval()
            with torch.no_grad():
                out = model(torch.from_numpy(example)).numpy()
            info = mlflow.pytorch.log_model(
                model,
                name="model",
                signature=infer_signature(example, out),
                input_example=example,
                serialization_format="pt2",  # torch.export graph: loads without our code and without unpickling
                pip_requirements=pinned("torch", "numpy", "pandas", "cloudpickle"),
                tags=tags,
            )
    if not registered_name:
        return None
    client = mlflow.MlflowClient()
    from mlflow.utils.logging_utils import MLFLOW_LOGGING_STREAM

    was, MLFLOW_LOGGING_STREAM.enabled = MLFLOW_LOGGING_STREAM.enabled, False  # its "Successfully registered" prints:
    try:  # the run's summary says where the model went
        version = mlflow.register_model(
            info.model_uri,
            registered_name,
            tags=tags
            if no_guarantee
            else {
                **tags,
                "dp.accountant": accountant,
                **({"dp.selection": selection} if selection else {}),
                **(version_tags or {}),
            },
        )
    finally:
        MLFLOW_LOGGING_STREAM.enabled = was
    client.update_model_version(
        registered_name,
        version.version,
        description=f"No differential-privacy guarantee: {no_guarantee} Run {run_id}."
        if no_guarantee
        else f"Trained with (ε={epsilon_text(epsilon, '.4g')}, δ={delta:g})-DP ({accountant}), run {run_id}."
        + (f" {selection}" if selection else ""),
    )
    return version


def pinned(*packages: str) -> list[str]:
    """``package==<installed version>`` for each package: the environment a logged model states.
    Given explicitly, MLflow does not infer it, which means loading the model in a fresh Python
    process (about 10 s on 2 cores, for a model of any size)."""
    from importlib.metadata import version

    return [f"{p}=={version(p)}" for p in packages]


def model_label(model: str) -> str:
    """``model`` as a registry name may hold it: no '/' or ':' (``hf:/models/all-MiniLM-L6-v2`` →
    ``hf_all-MiniLM-L6-v2``, ``tv:resnet18`` → ``tv_resnet18``)."""
    kind, _, ref = model.partition(":")
    if not ref:
        return model
    return f"{kind}_{Path(ref.rstrip('/')).name or ref}".replace("/", "_").replace(":", "_")


def skips_registry(cfg) -> bool:
    """True when a run's model is logged without registering it (``registered_model: none``)."""
    return (cfg.registered_model or "").lower() == "none"


def log_run_model(
    run_id: str, model, example, epsilon: float, cfg, prefix: str = "dp", data_dir=None, no_guarantee=None
):
    """Log a run's final model (if ``cfg.log_model``) and register it as ``cfg.registered_model``,
    by default ``<prefix>-<dataset>-<model>``; "none" logs it without registering. Returns the
    registered version, or None. An ``hf:`` model needs its ingested ``data_dir`` (the classes,
    max_length and e-mail view its texts were tokenized with). ``no_guarantee``: see :func:`log_model`."""
    if not cfg.log_model:
        return None
    name = cfg.registered_model or f"{prefix}-{cfg.dataset}-{model_label(cfg.model)}"
    registered = None if skips_registry(cfg) else name
    text = text_model_meta(cfg, data_dir)
    return log_model(
        run_id, model, example, registered, epsilon, cfg.target_delta, cfg.accountant, text, no_guarantee=no_guarantee
    )


def text_model_meta(cfg, data_dir) -> dict | None:
    """What a text model's pyfunc needs beside its weights, or None for other models."""
    if not str(cfg.model).startswith("hf:"):
        return None
    from ..data.shards import read_manifest
    from ..text.logged import text_meta

    return text_meta(cfg, read_manifest(data_dir))
