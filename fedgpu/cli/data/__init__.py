"""`fedgpu data ...`: datasets for demos and tests, made locally (one module per kind)."""
