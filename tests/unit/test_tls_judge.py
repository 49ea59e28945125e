"""The TLS diagnosis decides from what the probe saw (a pure function): each observation gives
its cause, and a working or silent address gives none."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from fedgpu.core.tls import TlsFiles
from fedgpu.core.tls_diagnosis import Cause, CertFacts, Seen, judge

NOW = dt.datetime(2026, 6, 1, tzinfo=dt.UTC)
CA = TlsFiles(None, None, Path("ca.crt"))
MINE = TlsFiles(Path("me.crt"), Path("me.key"), Path("ca.crt"))


def cert(names: tuple[str, ...] = ("localhost", "127.0.0.1"), days_from: int = -10,
         days_to: int = 300) -> CertFacts:
    return CertFacts(names, NOW + dt.timedelta(days=days_from), NOW + dt.timedelta(days=days_to),
                     "CN=fedgpu CA")


@pytest.mark.parametrize(("tls", "seen", "cause"), [
    (CA, Seen(tls=True, alpn="h2", cert=cert(("agg",)), verify_code=62, now=NOW),
     Cause.NAME_MISMATCH),
    (CA, Seen(tls=True, alpn="h2", cert=cert(days_to=-1), verify_code=10, now=NOW),
     Cause.EXPIRED),
    (CA, Seen(tls=True, alpn="h2", cert=cert(days_from=5), verify_code=9, now=NOW),
     Cause.NOT_YET_VALID),
    (CA, Seen(tls=True, alpn="h2", cert=cert(), verify_code=20, now=NOW), Cause.WRONG_CA),
    (CA, Seen(tls=True, alpn="h2", cert=cert(), closed_after_handshake=True, now=NOW),
     Cause.CLIENT_CERT_REQUIRED),
    (MINE, Seen(tls=True, alpn="h2", cert=cert(), alert="tlsv13 alert certificate required",
                now=NOW), Cause.CLIENT_CERT_REFUSED),
    (MINE, Seen(tls=True, alpn="h2", cert=cert(), own_cert=cert(days_to=-2), now=NOW),
     Cause.OWN_CERT_EXPIRED),
    (None, Seen(tls=True, alpn="h2", cert=cert(), now=NOW), Cause.SERVER_SPEAKS_TLS),
    (CA, Seen(plaintext="grpc", now=NOW), Cause.SERVER_PLAINTEXT),
    (None, Seen(plaintext="bulk", now=NOW), Cause.BULK_PORT),
    (CA, Seen(tls=True, alpn=None, inside_tls="bulk", now=NOW), Cause.BULK_PORT),
    (None, Seen(plaintext="http", now=NOW), Cause.HTTP_SERVER),
    (None, Seen(plaintext="other", now=NOW), Cause.NOT_GRPC),
])
def test_each_observation_has_its_cause(tls: TlsFiles | None, seen: Seen, cause: Cause) -> None:
    found = judge("127.0.0.1:50051", tls, seen)
    assert found is not None and found.cause is cause, found


def test_the_name_mismatch_line_lists_the_names_and_the_fix() -> None:
    seen = Seen(tls=True, alpn="h2", cert=cert(("aggregator", "agg.example.org", "10.0.0.5")),
                verify_code=64, now=NOW)
    assert str(judge("127.0.0.1:50051", CA, seen)) == (
        "the aggregator's certificate names aggregator, agg.example.org, 10.0.0.5 - not "
        "127.0.0.1: connect to one of those or re-issue with --san 127.0.0.1 ('fedgpu certs "
        "server --san 127.0.0.1 --force')")


@pytest.mark.parametrize(("tls", "seen"), [
    (CA, Seen(tls=True, alpn="h2", cert=cert(), now=NOW)),      # TLS that works
    (None, Seen(plaintext="grpc", now=NOW)),                     # plaintext that works
    (None, Seen(plaintext=None, now=NOW)),                       # nothing said a word
])
def test_nothing_to_say(tls: TlsFiles | None, seen: Seen) -> None:
    assert judge("127.0.0.1:50051", tls, seen) is None
