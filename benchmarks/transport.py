"""One large update node -> aggregator over loopback: raw TCP, fedgpu's gRPC stream, end to end.

Each receiver runs in its own process (as the aggregator would), the sender in this one:
    python -m benchmarks.transport raw|tls|bare|grpc --size-mib 256 [--chunk-kib 1024]
prints {"seconds", "gb_per_s"} for the best of --repeat sends. `bare` is gRPC's own ceiling
here: a stream of plain bytes messages, no protobuf and no fedgpu code on either side. `tls` is
the raw socket again inside TLS (Python's ssl, the aggregator's kind of certificate made for
the run): the ceiling of the bulk port over TLS. The fedgpu paths end to end, through the real
aggregator, are `python -m benchmarks.wire_e2e --path grpc|bulk [--tls]`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import ssl
import struct
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import MIB, ROOT, emit


def _receiver_raw(port_file: str, tls_dir: str = "") -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    print(srv.getsockname()[1], file=open(port_file, "w"), flush=True)  # noqa: SIM115
    ctx = None
    if tls_dir:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(f"{tls_dir}/server/server.crt", f"{tls_dir}/server/server.key")
    buf = bytearray(0)
    while True:
        conn, _ = srv.accept()
        if ctx is not None:
            conn = ctx.wrap_socket(conn, server_side=True)
        with conn:
            head = b""
            while len(head) < 8 and (part := conn.recv(8 - len(head))):
                head += part
            if len(head) < 8:
                return
            (size,) = struct.unpack("<Q", head)
            if len(buf) != size:
                buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                got += conn.recv_into(view[got:], min(size - got, 8 * MIB))
            conn.sendall(b"k")


def _send_raw(port: int, payload: memoryview, chunk: int, ctx: ssl.SSLContext | None = None
              ) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as raw, (
            ctx.wrap_socket(raw, server_hostname="localhost") if ctx else raw) as s:
        s.sendall(struct.pack("<Q", payload.nbytes))
        for pos in range(0, payload.nbytes, chunk):
            s.sendall(payload[pos : pos + chunk])
        assert s.recv(1) == b"k"
    return time.perf_counter() - start


async def _receiver_grpc(port_file: str) -> None:
    # fedgpu's server options and messages; the handler keeps only what transport needs:
    # every chunk copied into one preallocated buffer, no digest, no decode.
    import grpc

    from fedgpu.core.transport import SERVER_OPTIONS
    from fedgpu.proto import pb, pb_grpc

    class Sink(pb_grpc.FederationServicer):
        async def PushUpdate(self, request_iterator, context):  # type: ignore[no-untyped-def]
            first = await anext(aiter(request_iterator))
            buf = bytearray(first.header.payload_size)
            pos = 0
            async for msg in request_iterator:
                n = len(msg.data)
                buf[pos : pos + n] = msg.data
                pos += n
            return pb.PushReply(accepted=pos == len(buf))

    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_FederationServicer_to_server(Sink(), server)
    await _serve(server, port_file)


async def _serve(server, port_file: str) -> None:  # type: ignore[no-untyped-def]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, file=open(port_file, "w"), flush=True)  # noqa: SIM115
    await server.wait_for_termination()


async def _receiver_bare(port_file: str) -> None:
    import grpc

    from fedgpu.core.transport import SERVER_OPTIONS

    async def push(request_iterator, context):  # type: ignore[no-untyped-def]
        buf, pos = bytearray(0), 0
        async for data in request_iterator:
            if not buf:
                buf = bytearray(struct.unpack("<Q", data)[0])
                continue
            buf[pos : pos + len(data)] = data
            pos += len(data)
        return b"k" if pos == len(buf) else b"?"

    handler = grpc.method_handlers_generic_handler(
        "bench.Bare", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    await _serve(server, port_file)


def _send_bare(port: int, payload: memoryview, chunk: int, repeat: int) -> float:
    from fedgpu.core.transport import channel

    best = float("inf")
    with channel(f"127.0.0.1:{port}") as ch:
        push = ch.stream_unary("/bench.Bare/Push")

        def stream():  # type: ignore[no-untyped-def]
            yield struct.pack("<Q", payload.nbytes)
            for pos in range(0, payload.nbytes, chunk):
                yield payload[pos : pos + chunk].tobytes()

        for _ in range(repeat):
            start = time.perf_counter()
            assert push(stream(), timeout=120) == b"k"
            best = min(best, time.perf_counter() - start)
    return best


def _send_grpc(port: int, payload: np.ndarray, chunk: int, repeat: int) -> float:
    from fedgpu.core import codec
    from fedgpu.core.transport import channel
    from fedgpu.proto import pb, pb_grpc

    enc = codec.encode({"w": payload})
    best = float("inf")
    with channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.FederationStub(ch)

        def stream():  # type: ignore[no-untyped-def]
            yield pb.UpdateChunk(header=pb.UpdateHeader(payload_size=enc.size))
            for part in codec.iter_chunks(enc, chunk):
                yield pb.UpdateChunk(data=part)

        for _ in range(repeat):
            start = time.perf_counter()
            assert stub.PushUpdate(stream(), timeout=120).accepted
            best = min(best, time.perf_counter() - start)
    return best


def _start(kind: str, tmp: str) -> tuple[subprocess.Popen[bytes], int]:
    port_file = f"{tmp}/{kind}.port"
    extra = ["--tls-dir", tmp] if kind == "tls" else []
    receiver = "raw" if kind == "tls" else kind
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.transport", f"_{receiver}_receiver",
                             "--port-file", port_file, *extra], cwd=ROOT)
    for _ in range(200):
        try:
            return proc, int(open(port_file).read())
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{kind} receiver did not start")


def _tls_material(tmp: str) -> ssl.SSLContext:
    """A CA and an aggregator certificate as `fedgpu certs` makes them; the client context."""
    from pathlib import Path

    from fedgpu.core import certs

    certs.init_ca(Path(tmp))
    server = certs.issue_server(Path(tmp))
    return ssl.create_default_context(cafile=str(server.ca))


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["raw", "tls", "bare", "grpc", "_raw_receiver",
                                     "_bare_receiver", "_grpc_receiver"])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--port-file", default="")
    ap.add_argument("--tls-dir", default="")
    a = ap.parse_args()
    if a.mode == "_raw_receiver":
        return _receiver_raw(a.port_file, a.tls_dir)
    if a.mode == "_grpc_receiver":
        return asyncio.run(_receiver_grpc(a.port_file))
    if a.mode == "_bare_receiver":
        return asyncio.run(_receiver_bare(a.port_file))
    size = a.size_mib * MIB
    payload = np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _tls_material(tmp) if a.mode == "tls" else None
        proc, port = _start(a.mode, tmp)
        try:
            view = memoryview(payload.view(np.uint8))
            if a.mode in ("raw", "tls"):
                seconds = min(_send_raw(port, view, a.chunk_kib << 10, ctx)
                              for _ in range(a.repeat))
            elif a.mode == "bare":
                seconds = _send_bare(port, view, a.chunk_kib << 10, a.repeat)
            else:
                seconds = _send_grpc(port, payload, a.chunk_kib << 10, a.repeat)
        finally:
            proc.kill()
            proc.wait()
    emit({"mode": a.mode, "size_mib": a.size_mib, "chunk_kib": a.chunk_kib,
          "seconds": round(seconds, 4), "gb_per_s": round(size / seconds / 1e9, 3)})


if __name__ == "__main__":
    main()
