"""Simulated nodes (`fedgpu sim`): the node layer's own wire client, synthetic updates, no torch,
many per process on one event loop. A simulated node is a node: it registers, heartbeats,
long-polls and answers as the agent does, and survives an aggregator restart as the agent does.

- synthetic.py: the synthetic model, its per-node step and the update file's digest
- records.py:   the simulation's configuration and the statistics it writes
- node.py:      one simulated node (SimNode): registration, heartbeats, its task loop
- secure.py:    a simulated node's part in a secure round (node/secagg.py's protocol)
- run.py:       a process's nodes together (run_sim), until SIGTERM or the aggregator says stop
"""
