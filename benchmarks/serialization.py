"""Serialising 11M parameters: fedgpu's codec vs Flower's ndarrays_to_parameters and back.

    python -m benchmarks.serialization --impl fedgpu|flower
"""

from __future__ import annotations

import argparse

from benchmarks.common import best_of, emit, model_arrays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["fedgpu", "flower"], required=True)
    ap.add_argument("--params", type=int, default=11_000_000)
    ap.add_argument("--tensors", type=int, default=20)
    a = ap.parse_args()
    arrays = model_arrays(a.params, a.tensors, seed=0)
    doc: dict[str, object] = {"impl": a.impl, "params": a.params}
    if a.impl == "fedgpu":
        from fedgpu.core import codec

        named = {f"t{i:02d}": x for i, x in enumerate(arrays)}
        # Wire-ready: segments to send plus the digest the wire contract requires (BLAKE3),
        # and with sha256, the contract's digest before it.
        doc["digest"] = str(codec.WIRE_DIGEST)
        doc["encode_s"] = best_of(lambda: codec.encode(named))
        doc["encode_sha256_s"] = best_of(
            lambda: codec.encode(named, digest=codec.DigestAlgo.SHA256))
        doc["encode_no_digest_s"] = best_of(lambda: codec.encode(named, digest=None))
        # What a receiver holds: one contiguous buffer (the Assembler's).
        payload = codec.encode(named).to_bytes()
        doc["decode_s"] = best_of(lambda: codec.decode(payload))
    else:
        from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

        doc["encode_s"] = best_of(lambda: ndarrays_to_parameters(arrays))
        params = ndarrays_to_parameters(arrays)
        doc["decode_s"] = best_of(lambda: parameters_to_ndarrays(params))
    emit({k: round(v, 6) if isinstance(v, float) else v for k, v in doc.items()})


if __name__ == "__main__":
    main()
