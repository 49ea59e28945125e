"""`fedgpu doctor` (doctor.py): checks of this host for a deployment (checks.py), and of an
aggregator's bulk data path (bulk.py)."""
