"""Secure aggregation (SecAgg+, Bell et al. 2020; SecAgg, Bonawitz et al. 2017) for star jobs.

Shared by the node and the aggregator; numpy and `cryptography` only (no torch, no I/O).
The aggregator learns the weighted sum of the surviving sites' updates and nothing about one
site's update, while sites may drop out at any stage as long as `threshold` shareholders of
each needed secret survive.

    errors      the stages (StrEnum) and the failures: SecAggError, BelowThreshold
    shamir      t-of-n secret sharing over GF(2^521 - 1)
    crypto      X25519 key agreement, HKDF, ChaCha20-Poly1305 for shares in transit
    prg         AES-256-CTR mask expansion, streamed block by block
    quantize    clip, quantise, weight into Z_2^32 or Z_2^64; decode the unmasked sum
    graph       the random k-regular neighbour graph from a shared seed
    params      the job's Settings and one round's RoundParams
    messages    the protocol's messages and their byte encoding
    site        a site's state machine
    aggregator  the aggregator's state machine (streaming unmask)
    local       every party in one process (tests, simulation)
"""
