"""`fedgpu report` (report.py): plots and a summary of a run (plots.py)."""
