"""Experiment tracking: each job as one MLflow run (`fedgpu server start --tracking-uri`)."""
