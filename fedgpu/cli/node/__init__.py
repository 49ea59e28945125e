"""`fedgpu node ...`: the training agent and a site's allow-list, one module per command."""
