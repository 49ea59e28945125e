"""`fedgpu kit site|operator NAME`: a startup kit, one directory (and optionally a .tar.gz) that
holds everything a site needs to run `fedgpu node start --kit DIR`, or a person needs to
operate the federation with `--connection`."""
