"""`fedgpu task ...`: your own task as a bundle shipped with jobs: new.py writes one,
check.py runs it as a node would (dry_run.py), template.py is what `new` writes."""
