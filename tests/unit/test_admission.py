from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hedgerow.errors import NoHealthyWorker, RateLimited, RuntimeFault
from policies.admission import (
    Admission,
    AdmissionDecision,
    Admitted,
    Refused,
    AdmissionLimits,
    WaitPredictor,
)


def admit(adm: Admission, tenant: str = "t", tokens: float = 10, wait: float = 0.0,
          prefill: float = 0.0, deadline: float = 60.0, now: float = 0.0,
          queue: int = 0) -> AdmissionDecision:
    return adm.admit(tenant, tokens, wait, prefill, deadline, now, queue_length=queue)


def refused(decision: AdmissionDecision) -> Refused:
    assert isinstance(decision, Refused), decision
    return decision


def test_unlimited_tenant_is_admitted_and_counted() -> None:
    adm = Admission({}, max_queue=10)
    assert admit(adm) == Admitted("t", 10)
    assert adm.active("t") == 1
    adm.release("t")
    assert adm.active("t") == 0


def test_request_rate_refuses_with_retry_after_until_a_token() -> None:
    adm = Admission({"t": AdmissionLimits(requests_per_s=2, requests_burst=2)}, max_queue=10)
    assert isinstance(admit(adm, now=0.0), Admitted)
    assert isinstance(admit(adm, now=0.0), Admitted)
    refusal = refused(admit(adm, now=0.0))
    assert (refusal.status, refusal.reason) == (429, "requests_rate")
    assert refusal.retry_after_s == pytest.approx(0.5)
    assert isinstance(admit(adm, now=0.5), Admitted)


def test_tokens_per_minute_refuses_and_settle_gives_back_unused() -> None:
    adm = Admission({"t": AdmissionLimits(tokens_per_min=600)}, max_queue=10)  # 10 tokens/s
    assert isinstance(admit(adm, tokens=500), Admitted)
    refusal = refused(admit(adm, tokens=200))
    assert (refusal.status, refusal.reason) == (429, "tokens_rate")
    assert refusal.retry_after_s == pytest.approx(10.0)  # 100 left, 100 missing at 10/s
    assert adm.settle("t", estimated=500, actual=120, now=0.0) == -380
    assert isinstance(admit(adm, tokens=200), Admitted)


def test_settle_charges_an_underestimate_without_going_negative() -> None:
    adm = Admission({"t": AdmissionLimits(tokens_per_min=60, tokens_burst=100)}, max_queue=10)
    assert isinstance(admit(adm, tokens=50), Admitted)
    assert adm.settle("t", estimated=50, actual=80, now=0.0) == 30
    assert refused(admit(adm, tokens=21)).retry_after_s == pytest.approx(1.0)  # 20 left
    assert adm.settle("t", estimated=10, actual=1000, now=0.0) == 990
    refusal = refused(admit(adm, tokens=1))
    assert refusal.retry_after_s == pytest.approx(1.0)  # drained to zero, not below
    assert isinstance(admit(adm, tokens=1, now=1.0), Admitted)


def test_estimate_larger_than_burst_waits_for_a_full_bucket() -> None:
    adm = Admission({"t": AdmissionLimits(tokens_per_min=60, tokens_burst=100)}, max_queue=10)
    assert isinstance(admit(adm, tokens=10), Admitted)
    refusal = refused(admit(adm, tokens=1000))
    assert refusal.retry_after_s == pytest.approx(10.0)
    decision = admit(adm, tokens=1000, now=10.0)
    assert decision == Admitted("t", 100)
    adm.settle("t", estimated=1000, actual=40, now=10.0)
    assert isinstance(admit(adm, tokens=60, now=10.0), Admitted)


def test_concurrency_limit_and_release() -> None:
    adm = Admission({"t": AdmissionLimits(max_concurrency=2)}, max_queue=10,
                    concurrency_retry_after_s=2.5)
    admit(adm)
    admit(adm)
    refusal = refused(admit(adm))
    assert (refusal.status, refusal.reason, refusal.retry_after_s) == (429, "concurrency", 2.5)
    adm.release("t")
    assert isinstance(admit(adm), Admitted)


def test_queue_full_is_503() -> None:
    adm = Admission({}, max_queue=3)
    assert isinstance(admit(adm, queue=2, wait=4.0), Admitted)
    refusal = refused(admit(adm, queue=3, wait=4.0))
    assert (refusal.status, refusal.reason, refusal.retry_after_s) == (503, "queue_full", 4.0)


def test_hopeless_deadline_is_refused_now() -> None:
    adm = Admission({}, max_queue=100)
    assert isinstance(admit(adm, wait=3.0, prefill=1.0, deadline=4.5), Admitted)
    refusal = refused(admit(adm, wait=3.0, prefill=1.0, deadline=3.5))
    assert (refusal.status, refusal.reason) == (503, "deadline")
    assert refusal.retry_after_s == pytest.approx(0.5)


def test_infinite_wait_gives_bounded_retry_after() -> None:
    adm = Admission({}, max_queue=100, max_retry_after_s=30.0)
    refusal = refused(admit(adm, wait=math.inf, deadline=math.inf))
    assert refusal.reason == "deadline" and refusal.retry_after_s == 30.0


def test_tenant_limits_are_reported_before_capacity() -> None:
    adm = Admission({"t": AdmissionLimits(max_concurrency=1)}, max_queue=0)
    assert refused(admit(adm)).reason == "queue_full"
    adm2 = Admission({"t": AdmissionLimits(requests_per_s=1, requests_burst=1)}, max_queue=1)
    admit(adm2)
    assert refused(admit(adm2, queue=5)).reason == "requests_rate"


def test_refusal_consumes_nothing() -> None:
    limits = AdmissionLimits(requests_per_s=1, requests_burst=1, tokens_per_min=60,
                          tokens_burst=100, max_concurrency=1)
    adm = Admission({"t": limits}, max_queue=5)
    for decision in (admit(adm, queue=5), admit(adm, wait=10, deadline=1)):
        assert isinstance(decision, Refused)
    assert adm.active("t") == 0
    assert admit(adm, tokens=100) == Admitted("t", 100)  # full buckets still there


def test_tenants_are_independent_and_default_limits_apply() -> None:
    adm = Admission({"big": AdmissionLimits(max_concurrency=5)}, max_queue=10,
                    default_limits=AdmissionLimits(max_concurrency=1))
    admit(adm, tenant="small")
    assert refused(admit(adm, tenant="small")).reason == "concurrency"
    assert isinstance(admit(adm, tenant="other"), Admitted)
    for _ in range(5):
        assert isinstance(admit(adm, tenant="big"), Admitted)


def test_unbalanced_release_is_a_bug() -> None:
    adm = Admission({}, max_queue=10)
    with pytest.raises(RuntimeFault):
        adm.release("nobody")
    admit(adm)
    adm.release("t")
    with pytest.raises(RuntimeFault):
        adm.release("t")


def test_reconfigure_keeps_open_requests_and_resets_changed_buckets() -> None:
    adm = Admission({"t": AdmissionLimits(max_concurrency=2, requests_per_s=1)}, max_queue=10)
    admit(adm)
    assert refused(admit(adm)).reason == "requests_rate"
    adm.reconfigure({"t": AdmissionLimits(max_concurrency=1, requests_per_s=5)}, max_queue=10)
    assert adm.active("t") == 1
    assert refused(admit(adm)).reason == "concurrency"
    adm.release("t")
    assert isinstance(admit(adm), Admitted)


def test_refusal_maps_to_client_errors() -> None:
    rate = Refused(429, "tokens_rate", 2.4, "slow down").to_error()
    assert isinstance(rate, RateLimited) and rate.status == 429
    assert rate.envelope()["error"]["code"] == "tokens_rate"
    assert rate.headers() == [(b"retry-after", b"2")]
    full = Refused(503, "queue_full", 0.2, "full").to_error()
    assert isinstance(full, NoHealthyWorker) and full.status == 503
    assert full.headers() == [(b"retry-after", b"1")]


def test_rejects_invalid_limits_and_estimates() -> None:
    with pytest.raises(ValueError):
        AdmissionLimits(requests_per_s=0)
    with pytest.raises(ValueError):
        AdmissionLimits(max_concurrency=0)
    with pytest.raises(ValueError):
        admit(Admission({}, max_queue=1), tokens=-1)


@given(
    st.lists(st.tuples(st.integers(0, 400), st.floats(0, 3), st.integers(0, 20),
                       st.floats(0, 20), st.booleans()), max_size=60),
)
def test_refusals_never_consume_anything(
    calls: list[tuple[int, float, int, float, bool]],
) -> None:
    limits = AdmissionLimits(requests_per_s=2, requests_burst=3, tokens_per_min=600,
                          tokens_burst=500, max_concurrency=3)
    adm = Admission({"t": limits}, max_queue=10)
    now = 0.0
    for tokens, step, queue, wait, end_one in calls:
        now += step
        state = adm._state("t")
        assert state.requests is not None and state.tokens is not None
        before = (adm.active("t"), state.requests.level(now), state.tokens.level(now))
        decision = admit(adm, tokens=tokens, queue=queue, wait=wait, deadline=10, now=now)
        after = (adm.active("t"), state.requests.level(now), state.tokens.level(now))
        if isinstance(decision, Refused):
            assert after == before
            assert 0 <= decision.retry_after_s <= adm.max_retry_after_s
        else:
            assert after[0] == before[0] + 1
        if end_one and adm.active("t"):
            adm.release("t")
        assert adm.active("t") <= 3


# -- WaitPredictor ----------------------------------------------------------


def test_no_wait_while_a_slot_is_free() -> None:
    predictor = WaitPredictor(initial_service_s=2.0)
    assert predictor.predict_wait(queue_ahead=0, active=3, slots=4) == 0.0
    assert predictor.predict_wait(queue_ahead=0, active=4, slots=4) == pytest.approx(0.5)
    assert predictor.predict_wait(queue_ahead=8, active=4, slots=4) == pytest.approx(4.5)


def test_no_slots_means_infinite_wait() -> None:
    assert WaitPredictor().predict_wait(queue_ahead=0, active=0, slots=0) == math.inf


def test_service_time_is_an_ewma_seeded_by_the_first_sample() -> None:
    predictor = WaitPredictor(initial_service_s=100.0, alpha=0.5)
    predictor.observe_service(2.0)
    assert predictor.mean_service_s == 2.0
    predictor.observe_service(4.0)
    assert predictor.mean_service_s == 3.0
    with pytest.raises(ValueError):
        predictor.observe_service(math.nan)


@given(st.lists(st.floats(0, 1000), max_size=20), st.integers(0, 500), st.integers(0, 64),
       st.integers(0, 64), st.integers(1, 500))
def test_prediction_is_monotone_in_queue_length(samples: list[float], ahead: int, active: int,
                                               slots: int, more: int) -> None:
    predictor = WaitPredictor()
    for sample in samples:
        predictor.observe_service(sample)
    shorter = predictor.predict_wait(ahead, active, slots)
    longer = predictor.predict_wait(ahead + more, active, slots)
    assert 0 <= shorter <= longer


def test_a_request_without_a_worker_is_charged_to_the_requests_rate_only() -> None:
    limits = AdmissionLimits(requests_per_s=1, requests_burst=2, tokens_per_min=60,
                             max_concurrency=1)
    adm = Admission({"t": limits}, max_queue=10)
    assert adm.charge_request("t", 0.0) is None
    assert adm.charge_request("t", 0.0) is None
    refused = adm.charge_request("t", 0.0)
    assert refused is not None and (refused.status, refused.reason) == (429, "requests_rate")
    assert refused.retry_after_s == pytest.approx(1.0)
    assert adm.active("t") == 0  # no concurrency slot held
    assert adm.charge_request("t", 1.0) is None  # refilled
    # A tenant without a requests/s limit is never refused here.
    assert all(adm.charge_request("other", 0.0) is None for _ in range(100))


def test_a_request_charged_at_the_door_is_not_charged_again_at_admission() -> None:
    adm = Admission({"t": AdmissionLimits(requests_per_s=1, requests_burst=1)}, max_queue=10)
    assert adm.charge_request("t", 0.0) is None  # the bucket is now empty
    decision = adm.admit("t", 0, 0.0, 0.0, 10.0, 0.0, queue_length=0, charge_request=False)
    assert isinstance(decision, Admitted)
    refused = adm.admit("t", 0, 0.0, 0.0, 10.0, 0.0, queue_length=0)
    assert isinstance(refused, Refused) and refused.reason == "requests_rate"


def test_a_request_without_a_ticket_can_take_tokens_at_the_door_and_settle_them() -> None:
    # An embedding: requests/s and its input tokens, no concurrency slot.
    adm = Admission({"t": AdmissionLimits(tokens_per_min=0.6, tokens_burst=20)}, max_queue=10)
    assert adm.charge_request("t", 0.0, tokens=12) is None
    refused = adm.charge_request("t", 0.0, tokens=12)  # 8 left
    assert refused is not None and (refused.status, refused.reason) == (429, "tokens_rate")
    assert adm.active("t") == 0
    adm.settle("t", 12, 0, 0.0)  # the first failed: its 12 go back
    assert adm.charge_request("t", 0.0, tokens=12) is None
    with pytest.raises(ValueError):
        adm.charge_request("t", 0.0, tokens=float("nan"))
