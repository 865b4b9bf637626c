"""A service's enrollment with the issuer (`core.enroll.Enrollment`): the first certificate is
waited for through the issuer's failures, later ones are asked for at two thirds of the current
one's life and a failed renewal is tried again while the current certificate stays in use. The
issuer is a scripted stand-in here; tests/integration/test_issuer.py runs the real one."""

from __future__ import annotations

import datetime
import threading

import grpc
import pytest

from batchplane.core import enroll
from batchplane.core.enroll import Enrolled, Enrollment


class Refused(grpc.RpcError):
    def details(self) -> str:
        return "the issuer is not up yet"


class ScriptedIssuer:
    """Fails the first `failures` requests, then issues certificates valid for `life`."""

    def __init__(self, failures: int, life: datetime.timedelta) -> None:
        self.address = "issuer:8443"
        self.failures, self.life = failures, life
        self.requests = 0
        self.issued = threading.Semaphore(0)

    def request(self) -> Enrolled:
        self.requests += 1
        if self.requests <= self.failures:
            raise Refused()
        now = datetime.datetime.now(datetime.timezone.utc)
        self.issued.release()
        return Enrolled("batchplane://planner", now, now + self.life)


def test_renewal_is_due_at_two_thirds_of_the_life() -> None:
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    enrolled = Enrolled("batchplane://planner", start, start + datetime.timedelta(hours=24))
    assert enrolled.renew_in_s(start) == pytest.approx(16 * 3600)
    assert enrolled.renew_in_s(start + datetime.timedelta(hours=10)) == pytest.approx(6 * 3600)
    assert enrolled.renew_in_s(start + datetime.timedelta(hours=20)) == 0


def test_the_first_certificate_is_waited_for_and_later_ones_renewed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enroll, "FIRST_RETRY_S", 0.01)
    issuer = ScriptedIssuer(failures=3, life=datetime.timedelta(seconds=0.3))
    enrollment = Enrollment(issuer).start()  # type: ignore[arg-type]
    try:
        assert issuer.requests == 4 and enrollment.current is not None  # three refusals, then the certificate
        for _ in range(3):  # renewed again and again, each at two thirds of the last one's life
            assert issuer.issued.acquire(timeout=30)
        assert issuer.requests >= 6
    finally:
        enrollment.stop()


def test_a_stop_while_waiting_for_the_first_certificate_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enroll, "FIRST_RETRY_S", 0.01)
    enrollment = Enrollment(ScriptedIssuer(failures=10**9, life=datetime.timedelta(hours=1)))  # type: ignore[arg-type]
    threading.Timer(0.2, enrollment.stop).start()
    with pytest.raises(Exception, match="stopped before the issuer gave a certificate"):
        enrollment.start()
