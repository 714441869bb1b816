"""The engine thread: one :class:`~oasiskv.LLMEngine`, driven by commands from the HTTP side.

``LLMEngine`` is not thread-safe, so exactly one thread touches it::

    HTTP handlers (asyncio)                      engine thread
    -----------------------                      -------------
    submit() --_Add------> command queue ------>  add_request / abort_request
    abort()  --_Abort----> (thread-safe)          step() while there is work,
                                                  else block on the command queue
    RequestHandle.queue <-- call_soon_threadsafe --  each step's RequestOutputs

**Backpressure.** At most ``capacity = max_num_seqs + max_queue`` requests are held (submitted
and not finished, counted on the event loop); past that :meth:`EngineLoop.submit` raises
:class:`Overloaded` at once (the server answers 429 with ``Retry-After``), so neither the command
queue nor the engine's waiting queue grows without bound.

**Aborts.** A disconnected client's handler calls :meth:`EngineLoop.abort`; the engine thread
aborts the request, which returns its blocks to the pools at once, and the next step reports it
(``finish_reason="abort"``). A request counts against the capacity until the engine has reported
it finished, so the count never runs ahead of the blocks actually freed.

**Metrics.** The engine thread times each request (:class:`~oasiskv.serve.metrics.ServerMetrics`):
TTFT and end-to-end latency from its arrival, the inter-token latency between consecutive steps
that gave it tokens, and its queue time: arrival to the start of the step that admitted it.
Admission is first come, first served, so after a step the oldest requests not yet admitted,
as many as left the engine's waiting queue, are the ones that step admitted (a staged
disaggregated request may jump the queue; its neighbours' queue times are then off by a step).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..llm_engine import LLMEngine, RequestOutput, SamplingParams
from .metrics import ServerMetrics

log = logging.getLogger("oasiskv.serve")


class Overloaded(RuntimeError):
    """The server holds as many requests as it may; retry after ``retry_after_s``."""

    def __init__(self, capacity: int, retry_after_s: int = 1) -> None:
        super().__init__(f"the server is at capacity ({capacity} requests running or waiting); retry later")
        self.retry_after_s = retry_after_s


class EngineStopped(RuntimeError):
    """The engine thread is not running (not started, shut down, or it died)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread publishes after every step (read by ``/health`` and ``/metrics``)."""

    running: int = 0
    waiting: int = 0
    gpu_pages: int = 0
    gpu_free: int = 0
    host_blocks: int = 0
    host_free: int = 0
    gpu_reserved: int = 0
    host_reserved: int = 0
    admitted: int = 0  # requests the runtime holds blocks for
    page_bytes: int = 0  # bytes of one GPU page, K and V, every layer
    host_row_bytes: int = 0  # bytes of one host-pool block, K and V (and fp8 scales), every layer
    steps: int = 0
    step_errors: int = 0
    transfer_wait_s: float = 0.0  # Engine.transfer_wait: the compute stream's waits on transfers
    gpu_cap: int = 0  # the pools' caps (budgets) in blocks: what the usage fractions divide by
    host_cap: int = 0
    spec_drafts: int = 0  # LLMEngine.spec_stats over the engine's life: drafts verified, accepted
    spec_accepted: int = 0

    @property
    def pools_full(self) -> bool:
        """No request holds or reserves a block: every block is back in its pool."""
        return (
            self.admitted == 0
            and self.gpu_free == self.gpu_pages
            and self.host_free == self.host_blocks
            and self.gpu_reserved == 0
            and self.host_reserved == 0
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "pools_full": self.pools_full}


@dataclass(frozen=True)
class Accepted:
    """The engine queued the request."""


@dataclass(frozen=True)
class Rejected:
    """``add_request`` refused the request (``error`` is what it raised)."""

    error: BaseException


class RequestHandle:
    """The HTTP side of one request: its id and the queue its events arrive on
    (:class:`Accepted` / :class:`Rejected`, then one :class:`~oasiskv.RequestOutput` per step
    that made a token, the last one ``finished``)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()


@dataclass
class _Add:
    handle: RequestHandle
    loop: asyncio.AbstractEventLoop
    prompt_ids: list[int]
    params: SamplingParams
    stop: Callable[[list[int]], bool] | None
    arrival: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Live:
    """A request the engine holds (engine thread only)."""

    add: _Add
    first: float | None = None
    last: float | None = None
    admitted: bool = False
    aborted: bool = False


_STOP = object()


class EngineLoop:
    """Runs ``llm_engine`` in its own thread; see the module docstring.

    Args:
        llm_engine: the engine; nothing else may call it once :meth:`start` has run.
        max_queue: requests that may wait beyond the ``max_num_seqs`` running ones.
        metrics: where latency and token counts are recorded (default: a new
            :class:`~oasiskv.serve.metrics.ServerMetrics` labelled ``model_name``); its gauges read
            this loop's :attr:`snapshot`.
        model_name: the ``model_name`` label of the default metrics.
    """

    def __init__(
        self,
        llm_engine: LLMEngine,
        max_queue: int = 128,
        metrics: ServerMetrics | None = None,
        model_name: str = "oasiskv",
    ):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        self.llm_engine = llm_engine
        self.metrics = metrics or ServerMetrics(model_name)
        self.metrics.watch(lambda: self.snapshot)
        self.capacity = llm_engine.max_num_seqs + max_queue
        self.inflight = 0  # event-loop thread only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._steps = 0
        self._step_errors = 0
        e = llm_engine.engine
        self.snapshot = EngineSnapshot(
            page_bytes=e.page_bytes_all_layers, host_row_bytes=e.host_row_bytes_all_layers
        )
        self._wait_read_at = float("-inf")
        self._transfer_wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="oasis-engine", daemon=True)
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request, end the thread and wait for it (idempotent)."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)
        self._stopped = True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the HTTP side
    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: Callable[[list[int]], bool] | None = None,
        arrival: float | None = None,
    ) -> RequestHandle:
        """Hand a request to the engine and wait until it is queued.

        Raises :class:`Overloaded` past the capacity, :class:`EngineStopped` when the engine
        thread is not running, and whatever ``add_request`` raised (``ContextLengthError``,
        ``OutOfBlocksError``, ``ConfigError``) when the engine refuses the request.

        # Cancel safety
        Cancelling the wait aborts the request (if the engine queued it, it finishes as an abort).
        """
        if not self.alive:
            raise EngineStopped("the engine thread is not running")
        if self.inflight >= self.capacity:
            raise Overloaded(self.capacity)
        handle = RequestHandle(request_id)
        loop = asyncio.get_running_loop()
        self.inflight += 1
        arrival = time.monotonic() if arrival is None else arrival
        self._commands.put(_Add(handle, loop, prompt_ids, params, stop, arrival))
        try:
            event = await handle.queue.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(event, Rejected):
            raise event.error
        return handle

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored)."""
        self._commands.put(_Abort(request_id))

    def _deliver(self, handle: RequestHandle, event) -> None:
        """On the event loop: queue an event for its handler; count finished requests out."""
        if isinstance(event, Rejected) or (isinstance(event, RequestOutput) and event.finished):
            self.inflight -= 1
        handle.queue.put_nowait(event)

    # ------------------------------------------------------------------ the engine thread
    def _send(self, add: _Add, event) -> None:
        try:
            add.loop.call_soon_threadsafe(self._deliver, add.handle, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug in this module: no handler may wait forever
            log.exception("the engine thread died")
            for rid, live in self._live.items():
                err = f"the engine thread died: {e}"
                self._send(
                    live.add, RequestOutput(rid, live.add.prompt_ids, [], [], True, "error", None, err)
                )
            self._live.clear()
            raise

    def _loop(self) -> None:
        eng = self.llm_engine
        self._publish()
        while True:
            cmds = [] if eng.has_unfinished_requests() else [self._commands.get()]
            while True:
                try:
                    cmds.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd is _STOP:
                    self._shutdown()
                    return
                if isinstance(cmd, _Add):
                    self._add(cmd)
                else:
                    self._abort(cmd.request_id)
            if eng.has_unfinished_requests():
                self._step()
            self._publish()

    def _add(self, cmd: _Add) -> None:
        rid = cmd.handle.request_id
        try:
            self.llm_engine.add_request(cmd.prompt_ids, cmd.params, request_id=rid, stop=cmd.stop)
        except Exception as e:  # refused: ContextLengthError, OutOfBlocksError, ConfigError, ...
            self._send(cmd, Rejected(e))
            return
        self._live[rid] = _Live(cmd)
        self.metrics.add_prompt(len(cmd.prompt_ids))
        self._send(cmd, Accepted())

    def _abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.aborted = True
            self.llm_engine.abort_request(request_id)

    def _step(self) -> None:
        eng = self.llm_engine
        queued = [live for live in self._live.values() if not live.admitted and not live.aborted]
        start = time.monotonic()
        try:
            outs = eng.step()
        except Exception as e:  # a bug or a device failure: fail the batch, keep serving
            log.exception("engine step failed; finishing every request with an error")
            self._step_errors += 1
            outs = []
            for rid, live in list(self._live.items()):
                eng.abort_request(rid)
                prompt = live.add.prompt_ids
                outs.append(
                    RequestOutput(rid, prompt, [], [], True, "error", None, f"engine step failed: {e}")
                )
            try:
                eng.step()  # report (and drop) the aborted requests
            except Exception:
                log.exception("engine step failed again while aborting")
        self._steps += 1
        now = time.monotonic()
        m = self.metrics
        # First come, first served: the oldest of the requests that waited before this step, as
        # many as left the waiting queue, were admitted by it (see the module docstring).
        for live in queued[: max(0, len(queued) - eng.num_waiting)]:
            live.admitted = True
            m.queued(start - live.add.arrival)
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.new_token_ids:
                if not live.admitted:  # a staged request admitted ahead of older ones
                    live.admitted = True
                    m.queued(start - live.add.arrival)
                m.add_tokens(len(out.new_token_ids))
                if live.first is None:
                    live.first = now
                    m.first_token(now - live.add.arrival)
                else:
                    m.inter_token(now - live.last)
                live.last = now
            if out.finished:
                del self._live[out.request_id]
                n = len(out.token_ids)
                tpot = (live.last - live.first) / (n - 1) if n > 1 and live.first is not None else None
                m.finish(out.finish_reason or "abort", now - live.add.arrival, tpot, out.metrics)
            self._send(live.add, out)

    def _publish(self) -> None:
        eng = self.llm_engine
        rt = eng.engine.runtime
        kw = {}
        # The transfer-wait counters live on the device: read them at most twice a second (each
        # read is a small synchronous copy), between steps.
        now = time.monotonic()
        if now - self._wait_read_at >= 0.5:
            self._wait_read_at = now
            self._transfer_wait_s = eng.engine.transfer_wait()[0]
        spec = eng.spec_stats
        kw["spec_drafts"] = int(spec.get("drafts", 0))
        kw["spec_accepted"] = int(spec.get("accepted", 0))
        if rt is not None:
            # The host gauges count host rows (the host KV bytes); block ids are GPU summaries.
            (gp, _, hb), (gf, _, hf), (gr, _, hr) = rt.pool_sizes, rt.num_free, rt.reserved
            gcap, _, hcap = rt.caps
            kw.update(
                gpu_cap=gcap,
                host_cap=hcap,
                gpu_pages=gp,
                gpu_free=gf,
                host_blocks=hb,
                host_free=hf,
                gpu_reserved=gr,
                host_reserved=hr,
                admitted=rt.num_requests,
            )
        self.snapshot = EngineSnapshot(
            running=eng.num_running,
            waiting=eng.num_waiting,
            page_bytes=eng.engine.page_bytes_all_layers,
            host_row_bytes=eng.engine.host_row_bytes_all_layers,
            steps=self._steps,
            step_errors=self._step_errors,
            transfer_wait_s=self._transfer_wait_s,
            **kw,
        )

    def _shutdown(self) -> None:
        eng = self.llm_engine
        for rid in list(self._live):
            eng.abort_request(rid)
        if eng.has_unfinished_requests():
            self._step()
        self._publish()
