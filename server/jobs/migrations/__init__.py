"""The job database's numbered migrations (*.sql), applied in order by server/jobs/store.py.
A package only so that setuptools ships the files without calling the folder a stray package."""
