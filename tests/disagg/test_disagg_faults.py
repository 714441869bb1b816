"""Faults on the decode side of disaggregation, each through the Rust coordinator's reads: a
daemon killed or stalled mid-decode fails only the requests that need it (``finish_reason=
"error"`` with a message) and the pools come back whole; a released request or an entry of the
wrong size fails that request alone; a daemon stopped for a moment only slows the step; a
connection the daemon closed is reconnected within ``kv_retries``. The same while a full
transfer's admission streams a request in beside the others' steps (killed, stalled, wrong
size: it fails alone and the others never wait), and host pools that move under such a stream
stream it again."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from oasiskv import KvConfig, LLMEngine
from oasiskv._core import RtClient
from support.fakes import pools_are_full, prompt, tiny
from support.rtd import TRANSPORTS, Daemon
from support.staged import SMALL, M, P, all_released, fetch_steps, params, reference, staged_small

# Private names read here: ``RtClient`` from ``oasiskv._core`` (the daemon's client, to release
# and re-stage a request behind the engine's back); ``LLMEngine._prefilling`` (where a staged
# request waits while its blocks stream in) and the remote source's ``coord`` (its coordinator,
# which StreamHook wraps).


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.mark.parametrize("in_step", [False, True], ids=["reads-after-step", "in-step-reads"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_a_dead_daemon_fails_only_its_requests(model, fault, transport, in_step):
    with Daemon(transport=transport) as d:
        dry, h = staged_small(model, d, seeds=(3, 3))
        steps = fetch_steps(model, d, [dry], prompt(P, 11), n=40)
        assert len(steps) >= 2, steps
        timeout = 1.0
        eng = LLMEngine(
            model,
            kv=KvConfig.fast(**SMALL),
            drafter="ngram",
            kv_source=d.url,
            kv_timeout_s=timeout,
            kv_in_step_reads=in_step,
        )
        staged = eng.add_staged_request(h, params(40))
        local = eng.add_request(prompt(P, 11), params(40))
        last = {}
        for _ in range(steps[-1] - 1):  # up to the step before the last miss
            for o in eng.step():
                last[o.request_id] = o
        (d.kill if fault == "kill" else d.stop)()
        t = time.monotonic()
        while eng.has_unfinished_requests():
            for o in eng.step():
                last[o.request_id] = o
                if o.request_id == staged and o.finished:
                    failed_after = time.monotonic() - t
        assert last[staged].finish_reason == "error"
        assert "staging daemon" in last[staged].error
        assert failed_after < timeout + 2.0
        assert last[local].finish_reason == "length", last[local].error  # the engine went on
        assert len(last[local].token_ids) == 40
        assert pools_are_full(eng)
        assert eng.kv_source.stats.failures == 1
        if fault == "stall":
            d.cont()


@pytest.mark.parametrize("in_step", [False, True], ids=["reads-after-step", "in-step-reads"])
def test_a_released_request_fails_alone(model, in_step):
    """An entry the daemon no longer holds (released, or evicted after its lease) fails that
    request only: per-entry errors of a batched read. With in-step reads the step reader's read
    fails, the layer is still marked landed (the step goes on) and the other request completes."""
    with Daemon() as d:
        d1, d2, h1, h2 = staged_small(model, d, seeds=(3, 5, 3, 5))
        steps = fetch_steps(model, d, [d1, d2], None, n=40)
        eng = LLMEngine(
            model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_in_step_reads=in_step
        )
        a = eng.add_staged_request(h1, params(40))
        b = eng.add_staged_request(h2, params(40))
        last = {}
        for _ in range(steps[-1] - 1):
            for o in eng.step():
                last[o.request_id] = o
        assert eng.kv_source.client.release(h1.request_id) > 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                last[o.request_id] = o
        assert last[a].finish_reason == "error" and "unknown_request" in last[a].error
        assert last[b].finish_reason == "length", last[b].error
        assert pools_are_full(eng)


def test_a_lost_connection_is_reconnected_within_the_retries(model):
    """``kv_retries``: a read whose connection the daemon closed (here: idle past the daemon's
    ``--idle-timeout-s`` before the steps that read) reconnects and is sent again; the request
    goes on with the same tokens. Without retries the same loss fails the request."""
    for retries in (1, 0):
        with Daemon(idle_timeout_s=1) as d:
            dry, h = staged_small(model, d, seeds=(3, 3))
            steps = fetch_steps(model, d, [dry], None, n=M)
            assert len(steps) >= 2, steps
            eng = LLMEngine(
                model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_retries=retries
            )
            rid = eng.add_staged_request(h, params())
            last, k = {}, 0
            while eng.has_unfinished_requests():
                k += 1
                if k == steps[1]:  # (steps[0] may be the admission's, before any connection)
                    time.sleep(1.6)  # every connection idles out before this step's read
                for o in eng.step():
                    last[o.request_id] = o
            o = last[rid]
            if retries:
                (ref,) = reference(model, KvConfig.fast(**SMALL), "oasis", [h.prompt])
                assert o.finish_reason == "length", o.error
                assert o.token_ids == ref.token_ids and o.metrics.network_fetched_bytes > 0
                assert eng.kv_source.coordinator_stats["reconnects"] >= 1
            else:
                assert o.finish_reason == "error" and "staging daemon" in o.error
            assert pools_are_full(eng)


def test_a_stalled_daemon_only_slows_the_decode(model):
    """A daemon that stops answering for a while (SIGSTOP, then SIGCONT well within
    ``kv_timeout_s``) mid-decode: the reads wait for it, and the tokens are unchanged."""
    with Daemon() as d:
        dry, h = staged_small(model, d, seeds=(3, 3))
        steps = fetch_steps(model, d, [dry], None, n=M)
        eng = LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_timeout_s=20)
        rid = eng.add_staged_request(h, params())
        last, k, stalled = {}, 0, 0.0
        while eng.has_unfinished_requests():
            k += 1
            if k == steps[-1]:
                d.stop()
                threading.Timer(0.5, d.cont).start()
                t = time.monotonic()
            for o in eng.step():
                last[o.request_id] = o
            if k == steps[-1]:
                stalled = time.monotonic() - t
        (ref,) = reference(model, KvConfig.fast(**SMALL), "oasis", [h.prompt])
        assert last[rid].finish_reason == "length", last[rid].error
        assert last[rid].token_ids == ref.token_ids
        assert stalled >= 0.4  # the step waited for the stalled daemon
        assert eng.kv_source.stats.wait_seconds >= 0.4 and eng.kv_source.stats.failures == 0
        assert pools_are_full(eng)


def test_a_read_of_the_wrong_size_fails_that_request_alone(model):
    """A staged request whose blocks the daemon now holds in another geometry (released and
    staged again with twice the head dim): its next reads return entries of the wrong size,
    which the coordinator refuses without writing them; that request fails, the other in the
    batch completes, and the pools come back whole."""
    with Daemon() as d:
        d1, d2, h1, h2 = staged_small(model, d, seeds=(3, 5, 3, 5))
        steps = fetch_steps(model, d, [d1, d2], None, n=40)
        eng = LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url)
        a = eng.add_staged_request(h1, params(40))
        b = eng.add_staged_request(h2, params(40))
        last = {}
        for _ in range(steps[-1] - 1):
            for o in eng.step():
                last[o.request_id] = o
        layers, hk, bs, dim, elem, nb, fmt = h1.geometry
        wide = (layers, hk, bs, 2 * dim, elem, nb, fmt)
        c = RtClient(d.url)
        assert c.release(h1.request_id) > 0
        for layer in range(layers):
            blocks = torch.ones(nb * 2 * hk * bs * 2 * dim * elem, dtype=torch.uint8)
            c.stage_blocks(h1.request_id, wide, [(layer, i) for i in range(nb)], blocks)
        while eng.has_unfinished_requests():
            for o in eng.step():
                last[o.request_id] = o
        assert last[a].finish_reason == "error" and "size_mismatch" in last[a].error, last[a].error
        assert last[b].finish_reason == "length", last[b].error
        assert eng.kv_source.coordinator_stats["failed_entries"] > 0
        assert pools_are_full(eng)
        c.release(h1.request_id)
        c.close()


class StreamHook:
    """The remote source's coordinator, with ``before()`` run once, just as an admission hands it
    a staged request's blocks to stream in (``submit(..., background=True)``): a fault strikes
    after the admission has read its sections and reserved its rows, before any block lands."""

    def __init__(self, src, before) -> None:
        self.inner, self.before = src.coord, before

    def submit(self, layers, rows, heads, *, background=False, prefetch=0):
        if background and self.before is not None:
            self.before()
            self.before = None
        return self.inner.submit(layers, rows, heads, background=background, prefetch=prefetch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def full_transfer_engine(model, d: Daemon, timeout_s: float) -> LLMEngine:
    """A decode engine reading ``d``'s staged requests by full transfer (the Quest selection, the
    small geometry), every call to the daemon bounded by ``timeout_s``."""
    return LLMEngine(
        model,
        kv=KvConfig.fast(**SMALL),
        drafter="ngram",
        kv_source=d.url,
        kv_transfer="full",
        kv_timeout_s=timeout_s,
    )


def stream_fault(model, d: Daemon, fault, timeout_s: float = 30.0) -> tuple[dict, list[str], list, float]:
    """A full transfer's engine with a local request and a staged one decoding, then a second
    staged request admitted while they decode, ``fault(handle)`` striking as its blocks are handed
    to the coordinator. Returns the last outputs by id, the ids (local, first, second), the ids in
    the order they finished and the longest step that made a token for the others."""
    h1, h2 = staged_small(model, d, seeds=(3, 5))
    eng = full_transfer_engine(model, d, timeout_s)
    local = eng.add_request(prompt(P, 11), params(M))
    first = eng.add_staged_request(h1, params(M))
    eng.step()
    eng.step()  # both decode: the next admission streams in beside their steps
    eng.kv_source.coord = StreamHook(eng.kv_source, lambda: fault(h2))
    second = eng.add_staged_request(h2, params(M))
    last, finished, longest = {}, [], 0.0
    while eng.has_unfinished_requests():
        t = time.monotonic()
        outs = eng.step()
        if any(o.request_id != second and o.new_token_ids for o in outs):
            longest = max(longest, time.monotonic() - t)
        for o in outs:
            last[o.request_id] = o
            if o.finished:
                finished.append(o.request_id)
    assert pools_are_full(eng)
    assert eng.kv_source.coord.missing == 0  # nothing of the failed request is left to read
    eng.kv_source.close()
    return last, [local, first, second], finished, longest


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_a_daemon_lost_while_an_admission_streams_fails_that_request_alone(model, fault):
    """``kv_transfer="full"``: the daemon dies (or stops answering) as a staged request's blocks
    are handed to the coordinator, while a local request and an admitted staged one decode. The
    others never wait for it (no step of theirs comes near ``kv_timeout_s``) and finish with their
    tokens (the staged one's equal the single-process engine's); the streaming request ends with
    ``finish_reason="error"`` and the message, within ``kv_timeout_s`` (a stall costs one frame's
    deadline: its other frames are dropped unsent), nothing of it marked present, and the pools
    come back whole."""
    with Daemon() as d:
        timeout = 2.0
        t0 = time.monotonic()
        last, (local, first, second), finished, longest = stream_fault(
            model, d, lambda h: (d.kill if fault == "kill" else d.stop)(), timeout_s=timeout
        )
        took = time.monotonic() - t0
        if fault == "stall":
            d.cont()
        assert last[second].finish_reason == "error", last[second]
        assert "staging daemon" in last[second].error, last[second].error
        assert last[second].token_ids == []
        for rid in (local, first):
            assert last[rid].finish_reason == "length", last[rid].error
            assert len(last[rid].token_ids) == M
        assert longest < timeout / 2, longest
        if fault == "stall":
            assert finished.index(second) == 2, finished  # the others did not wait for it
            assert took < 3 * timeout + 10, took
    (ref,) = reference(model, KvConfig.fast(**SMALL), "oasis", [prompt(P, 3)])
    assert last[first].token_ids == ref.token_ids


def test_a_wrong_size_reply_while_an_admission_streams_fails_that_request_alone(model):
    """``kv_transfer="full"``: the staged request being streamed in is released and staged again
    with twice the head dim as its blocks are handed over; every reply entry has the wrong size,
    which the coordinator refuses without writing: that request fails (``size_mismatch``), the
    others finish, the pools come back whole."""
    with Daemon() as d:

        def restage_wide(h):
            layers, hk, bs, dim, elem, nb, fmt = h.geometry
            c = RtClient(d.url)
            assert c.release(h.request_id) > 0
            wide = (layers, hk, bs, 2 * dim, elem, nb, fmt)
            for layer in range(layers):
                blocks = torch.ones(nb * 2 * hk * bs * 2 * dim * elem, dtype=torch.uint8)
                c.stage_blocks(h.request_id, wide, [(layer, i) for i in range(nb)], blocks)
            c.close()

        last, (local, first, second), _, _ = stream_fault(model, d, restage_wide)
        assert last[second].finish_reason == "error"
        assert "size_mismatch" in last[second].error, last[second].error
        for rid in (local, first):
            assert last[rid].finish_reason == "length", last[rid].error


def test_pools_that_move_while_an_admission_streams_stream_it_again(model):
    """The engine grows the host pool by copying it into new tensors. When that happens while a
    staged request's blocks are in flight (here: the daemon stopped as they are handed over, the
    pools grown as a local request's admission would, then the daemon let go), the blocks that
    land after the copy wrote the old pool: the request is streamed again into the new one, and
    its tokens equal the single-process engine's."""
    (ref,) = reference(model, KvConfig.fast(**SMALL), "oasis", [prompt(P, 3)])
    with Daemon() as d:
        (h,) = staged_small(model, d, seeds=(3,))
        eng = LLMEngine(
            model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_transfer="full"
        )
        local = eng.add_request(prompt(P, 11), params(M))
        eng.step()  # the local request decodes: the admission streams beside it
        eng.kv_source.coord = StreamHook(eng.kv_source, d.stop)
        staged = eng.add_staged_request(h, params(M))
        last = {}
        pools = eng.engine.pools
        while not any(s.staged is not None for s in eng._prefilling):
            for o in eng.step():
                last[o.request_id] = o
        rows = pools.num_host_rows
        eng.engine.reserve_pools([(4 * P, M)] * 4)
        assert pools.num_host_rows > rows  # the host pool moved under the stream in flight
        d.cont()
        while eng.has_unfinished_requests():
            for o in eng.step():
                last[o.request_id] = o
        assert last[staged].finish_reason == "length", last[staged].error
        assert last[local].finish_reason == "length", last[local].error
        assert last[staged].token_ids == ref.token_ids
        nb = -(-P // SMALL["block_size"])
        layers, hk = h.geometry[0], h.geometry[1]
        # Every block-head was read twice: before the move (landing in the old pool) and after.
        assert eng.kv_source.coordinator_stats["sent_entries"] == 2 * layers * nb * hk
        assert pools_are_full(eng)
        eng.kv_source.close()


def test_a_request_aborted_while_its_blocks_stream_in_gives_everything_back(model):
    """A staged request aborted while its blocks stream in (the daemon stopped for 0.3 s as they
    are handed over): its end drops the frames not sent yet and waits for the one being read
    only; it reports ``"abort"``, the other request finishes, the pools come back whole and the
    daemon's copy is released."""
    with Daemon() as d:
        (h,) = staged_small(model, d, seeds=(3,))
        eng = LLMEngine(
            model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_transfer="full"
        )
        src = eng.kv_source
        src.read_connections = 1
        local = eng.add_request(prompt(P, 11), params(M))
        eng.step()
        src.coord = StreamHook(src, d.stop)
        staged = eng.add_staged_request(h, params(M))
        last = {}
        while not any(s.staged is not None for s in eng._prefilling):
            for o in eng.step():
                last[o.request_id] = o
        threading.Timer(0.3, d.cont).start()
        eng.abort_request(staged)
        while eng.has_unfinished_requests():
            for o in eng.step():
                last[o.request_id] = o
        assert last[staged].finish_reason == "abort"
        assert last[local].finish_reason == "length", last[local].error
        c = src.coordinator_stats
        assert c["frames"] == 1, c  # one frame per layer: the first was being read, the rest dropped
        assert c["sent_entries"] == c["entries"] + c["failed_entries"] and c["failed_entries"] > 0
        assert pools_are_full(eng) and src.coord.missing == 0
        assert all_released(src.client)
        src.close()


def test_prefill_only_counts_a_streaming_admission_as_progress(model):
    """``prefill_only()`` beside decoding requests while a staged request's blocks are still
    streaming in (the daemon stopped as they are handed over): progress, not "does not fit" (the
    Fig. 11 drive stops on the latter); the admission lands or fails by itself, and the others
    finish."""
    with Daemon() as d:
        _, h2 = staged_small(model, d, seeds=(3, 5))
        eng = full_transfer_engine(model, d, 2.0)
        local = eng.add_request(prompt(P, 11), params(M))
        eng.step()
        eng.step()  # decoding: the admission below streams beside it
        eng.kv_source.coord = StreamHook(eng.kv_source, d.stop)
        second = eng.add_staged_request(h2, params(M))
        # Its data read ahead, then its blocks handed to the coordinator (the daemon stops
        # there): for a second, well within kv_timeout_s, every round is progress.
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            rnd = eng.prefill_only()
            assert rnd.progressed and rnd.done == []
            time.sleep(0.05)
        assert eng.kv_source.coord.missing > 0  # still streaming: nothing of it landed
        last = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                last[o.request_id] = o
        d.cont()
        assert last[local].finish_reason == "length"
        assert last[second].finish_reason == "error" and "staging daemon" in last[second].error
        assert pools_are_full(eng)
        eng.kv_source.close()
