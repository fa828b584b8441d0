"""The MLflow model-from-code of a fine-tuned text classifier: MLflow copies this file into the
logged model and runs it at load, so no Python object is unpickled (see :mod:`.logged`)."""

import mlflow

from pipelines.text.logged import TextClassifier

mlflow.models.set_model(TextClassifier())
