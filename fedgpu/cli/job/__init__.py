"""`fedgpu job ...`: jobs on a federation that stays up, one module per command."""
