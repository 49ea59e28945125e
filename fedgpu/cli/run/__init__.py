"""`fedgpu run` (run.py): a whole federation on this machine, and what it is made of: the
launcher of the local processes, their data, and how nodes share agent processes."""
