"""pipelines: data, models and the training job that compose dpcore (Ray and MLflow come in
with the sharded pipeline)."""
