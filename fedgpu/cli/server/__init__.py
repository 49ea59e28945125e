"""`fedgpu server ...`: the aggregator."""
