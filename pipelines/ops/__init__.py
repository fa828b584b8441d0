"""Operations around the library: the local stack (PostgreSQL, MLflow, a Ray head), job
submission through the Ray Jobs API, and the step benchmark beside Opacus. Nothing in the
library (dpcore, the rest of pipelines) imports from here."""
