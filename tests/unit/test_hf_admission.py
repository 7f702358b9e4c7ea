"""The transformers engine's admission batching: while rows decode, new requests wait to be prefilled
together until they are `prefill_ratio` times the running rows or have waited `prefill_wait_steps`
decode steps (a full engine, or an idle one, prefills at once). Each case pauses the engine, queues
the new requests, resumes it, and counts the decode steps run before their prefill."""

from __future__ import annotations

import threading
import time

import pytest

from libra.services.rollout.engines.hf_engine import HFEngine, Request

from tests.fixtures_model import make_random_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_random_llama(tmp_path_factory.mktemp("admission") / "model", seed=0))


def _engine(model_dir: str, ratio: float, wait: int, max_num_seqs: int = 64) -> tuple[HFEngine, list]:
    engine = HFEngine(model_dir, max_model_len=256, max_num_seqs=max_num_seqs, prefill_ratio=ratio,
                      prefill_wait_steps=wait)
    engine.eos_id = -1  # a random model may say EOS at any step: only max_tokens ends a row here
    events: list = []
    decode, prefill = engine._decode, engine._prefill
    engine._decode = lambda: (events.append("decode"), decode())[1]
    engine._prefill = lambda fresh: (events.append(("prefill", len(fresh))), prefill(fresh))[1]
    return engine, events


def _request(max_tokens: int, finished: threading.Semaphore) -> Request:
    return Request([5, 6, 7, 8], max_tokens, 0.0, 1.0, frozenset(), None, lambda r: finished.release())


def _wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        time.sleep(0.002)


def _decodes_before_prefill(model_dir: str, ratio: float, wait: int, running: int, arriving: int,
                            max_num_seqs: int = 64) -> tuple[int, int]:
    """(decode steps between the resume and the arrivals' prefill, rows in that prefill)."""
    engine, events = _engine(model_dir, ratio, wait, max_num_seqs)
    finished = threading.Semaphore(0)
    try:
        first = [_request(200, finished) for _ in range(running)]
        for request in first:
            engine.submit(request)
        _wait_for(lambda: engine.running == running)
        engine.pause(True)
        time.sleep(0.1)  # the decode step in progress, if any, ends; no other starts
        later = [_request(5, finished) for _ in range(arriving)]
        for request in later:
            engine.submit(request)
        assert engine.waiting == arriving  # accepted, not prefilled (what /metrics reports as waiting)
        mark = len(events)
        engine.pause(False)
        for _ in range(running + arriving):
            assert finished.acquire(timeout=30)
        after = events[mark:]
        at = next(i for i, event in enumerate(after) if event != "decode")
        assert all(len(r.generated) == r.max_tokens for r in first + later)
        prefills = [event[1] for event in events if event != "decode"]  # what /metrics counts
        assert engine.passes == {"prefill": len(prefills), "decode": events.count("decode")}
        assert engine.rows_passed["prefill"] == sum(prefills) == running + arriving
        return at, after[at][1]
    finally:
        engine.stop()


def test_an_arrival_waits_prefill_wait_steps_while_few_wait(model_dir):
    # 1 running, 1 arriving: 1 < 2.0 x 1, so it waits its 6 decode steps, then is prefilled alone
    assert _decodes_before_prefill(model_dir, 2.0, 6, running=1, arriving=1) == (6, 1)


def test_arrivals_are_prefilled_at_once_when_they_reach_the_ratio(model_dir):
    # 4 running: 2 arrivals reach 0.5 x 4 and are prefilled together at the next step
    assert _decodes_before_prefill(model_dir, 0.5, 50, running=4, arriving=2) == (0, 2)
    # 1 arrival does not reach it: it waits the 3 steps
    assert _decodes_before_prefill(model_dir, 0.5, 3, running=4, arriving=1) == (3, 1)


def test_no_batching_and_a_full_engine_prefill_at_once(model_dir):
    assert _decodes_before_prefill(model_dir, 0.0, 0, running=2, arriving=1) == (0, 1)
    # the running rows and the arrival fill max_num_seqs: nothing more can join, so no waiting
    assert _decodes_before_prefill(model_dir, 4.0, 50, running=2, arriving=1, max_num_seqs=3) == (0, 1)


def test_bad_admission_settings_are_refused(model_dir):
    with pytest.raises(ValueError, match="prefill_ratio, prefill_wait_steps and prefix_cache_mib must be >= 0"):
        HFEngine(model_dir, prefill_ratio=-1.0)
    with pytest.raises(ValueError, match="prefix_cache_mib must be >= 0"):
        HFEngine(model_dir, prefix_cache_mib=-1.0)


def test_the_config_and_the_engine_server_default_to_the_same_admission():
    from libra.services.rollout.config import HfEngine
    from libra.services.rollout.engines.hf_engine import PREFILL_RATIO, PREFILL_WAIT_STEPS, PREFIX_CACHE_MIB

    assert (HfEngine().prefill_ratio, HfEngine().prefill_wait_steps) == (PREFILL_RATIO, PREFILL_WAIT_STEPS)
    assert HfEngine().prefix_cache_mib == PREFIX_CACHE_MIB


def test_each_request_reports_the_batch_its_tokens_were_sampled_in(model_dir):
    """`decode_batch`: the mean rows of the passes that sampled a request's ids (the engine's own
    batch, which the turn record carries for the calibration: requests held back are not in it).
    Two requests prefilled together, of 3 and 6 tokens: the first's three ids come from passes of
    2 rows; the second's from 2, 2, 2, then 1, 1, 1 once the first is done."""
    engine, _ = _engine(model_dir, 0.0, 0)
    finished = threading.Semaphore(0)
    try:
        engine.pause(True)
        short, long = _request(3, finished), _request(6, finished)
        engine.submit(short)
        engine.submit(long)
        engine.pause(False)
        for _ in range(2):
            assert finished.acquire(timeout=30)
        assert (len(short.generated), len(long.generated)) == (3, 6)
        assert short.decode_batch == pytest.approx(2.0) and long.decode_batch == pytest.approx(1.5)
        assert Request([1], 1, 0.0, 1.0, frozenset(), None, lambda r: None).decode_batch == 0.0  # none sampled
    finally:
        engine.stop()
