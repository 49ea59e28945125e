"""The base every other part builds on: wire codec, job config, TLS, transport, errors, logs,
packaged datasets. Imports nothing of fedgpu.node, fedgpu.server or fedgpu.cli (checked by
import-linter), and never torch or pynvml: the aggregator image carries it."""
