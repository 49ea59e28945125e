"""Federated statistics (`mode = "statistics"`): what a site computes, releases and sends, and
how the aggregator combines the sites' releases. Pure numpy; no torch.

- `columns.py`: a column's spec (name, range, bins, values per record) and a site's summary of
  it (count, shifted sum and sum of squares, histogram), quantiles from a histogram.
- `release.py`: what leaves a site: cells under `min_count` suppressed on the site, optional
  Laplace or Gaussian noise.
- `combine.py`: per-site and combined figures; combined quantiles come from the merged
  histograms (error at most one bin width).
- `wire.py`: the JSON document a site sends, read back with limits and checks.

Threat model: docs/explanation/federated-statistics.md and tests/unit/test_fedstats_*.py.
"""
