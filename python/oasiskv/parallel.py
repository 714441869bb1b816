"""Tensor parallelism: one OasisKV engine per rank, each over its own KV heads (issue 14).

OasisKV is head-parallel by construction: each rank of a tensor-parallel group holds the K/V of
``num_key_value_heads / tp`` heads, and with them their pools, tables, summaries and selection.
No KV crosses ranks; the model's usual collectives (:mod:`oasiskv.models.tp`: two all-reduces a
layer, one for the embedding, an all-gather of the logits) are the only traffic of a forward.
With ``tp`` a multiple of the KV heads each KV head is held by ``tp / num_key_value_heads``
ranks (replication), which also sum their block scores before each top-K
(:meth:`TPGroup.replica_sum`) so that they select the same blocks.

Three pieces:

* :class:`TPGroup` -- the ranks (``torch.distributed``: NCCL on GPUs, gloo on the CPU), plus a
  gloo group for the control plane. Every collective of a group that lost a rank raises
  :class:`~oasiskv.errors.TensorParallelError` (gloo notices a dead peer at once; a peer that
  hangs is caught by the group's timeout), and so does every later one.
* :func:`run_tp` -- the engine's own launcher: ``tp`` spawned processes on a free loopback port,
  watched; a rank that dies or raises ends the run with :class:`~oasiskv.errors.RankFailedError`
  naming it. Or :func:`init_tp` under ``torchrun``.
* :class:`TPLLMEngine` -- an :class:`~oasiskv.LLMEngine` on rank 0 (the *driver*: admission,
  sampling, drafting, dense -> sparse transitions, all decided once there), whose
  :class:`~oasiskv.engine.Engine` calls are broadcast to the other ranks (*workers*), which
  replay them on their own engines in the same order.

Example (``run_tp`` spawns the ranks; ``job`` runs on each)::

    from oasiskv import KvConfig, SamplingParams
    from oasiskv.models.tp import TPCausalLM
    from oasiskv.parallel import TPLLMEngine, run_tp

    def job(group, cfg, prompts):
        model = TPCausalLM.random(cfg, seed=0, group=group)  # or TPCausalLM.from_full(full, group)
        eng = TPLLMEngine(model, kv=KvConfig(top_k_blocks=64))
        if not eng.is_driver:
            eng.worker_loop()  # follows rank 0 until it calls shutdown()
            return None
        try:
            ids = [eng.add_request(p, SamplingParams(max_tokens=32)) for p in prompts]
            return {rid: out.token_ids for rid, out in eng.run_to_completion(ids).items()}
        finally:
            eng.shutdown()

    tokens = run_tp(job, tp=2, args=(cfg, prompts))[0]  # rank 0's return value

With ``torchrun --nproc-per-node 2 script.py`` instead, the script calls ``group = init_tp()``
(which reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``), then
``job(group, ...)``, then :func:`shutdown_tp`; torchrun's agent ends the other ranks when one fails.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import errors as _errors
from .engine import Request
from .errors import ConfigError, RankFailedError, TensorParallelError

#: Seconds a collective waits for the other ranks before it fails (a hung rank; a dead one is
#: noticed at once). Arbitrary. Workers wait for the driver's next command under the same limit,
#: so a driver idle for longer ends them: a server should pass a larger ``timeout_s``.
DEFAULT_TIMEOUT_S = 600.0
#: Seconds :func:`run_tp` lets the other ranks report their own error after one rank failed,
#: before it terminates them. Arbitrary: they fail within milliseconds when a peer dies.
DEFAULT_GRACE_S = 10.0


# ------------------------------------------------------------------------------------------ group
@dataclass
class TPGroup:
    """The ranks of one tensor-parallel model.

    ``group`` carries the model's collectives (NCCL or gloo; ``None`` in one process),
    ``cpu_group`` (gloo) the engine's commands and statuses. ``broken`` is set by the first
    collective that failed; from then on every collective raises it.
    """

    rank: int
    size: int
    device: torch.device
    group: object | None = None
    cpu_group: object | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    broken: TensorParallelError | None = None

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> TPGroup:
        """One process, no ``torch.distributed``: every collective is the identity."""
        return cls(0, 1, torch.device(device))

    def _run(self, what: str, fn: Callable):
        if self.broken is not None:
            raise self.broken
        try:
            return fn()
        except RuntimeError as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            err = TensorParallelError(
                f"rank {self.rank}: {what} over the tensor-parallel group failed: a rank died or did not "
                f"answer within {self.timeout_s:g} s ({first})"
            )
            self.broken = err
            raise err from e

    def check(self) -> None:
        """Raise the group's error if a collective has failed."""
        if self.broken is not None:
            raise self.broken

    # ---------------------------------------------------------------- the model's collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.size > 1:
            self._run("all_reduce", lambda: dist.all_reduce(t, group=self.group))
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` (same shape everywhere), concatenated in rank order along ``dim``."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run("all_gather", lambda: dist.all_gather(parts, t, group=self.group))
        return torch.cat(parts, dim=dim)

    def replica_sum(self, replicas: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function summing a tensor over this rank's *replicas*: the ``replicas`` consecutive
        ranks ``r - r % replicas ..`` that hold the same KV head (KV-head replication, ``tp`` a
        multiple of the KV heads). It all-gathers the members' tensors (same shape everywhere) on
        a process group of the replicas and adds them in rank order, so every member gets the same
        bits (an all-reduce may not promise that, and the replicas must select the same blocks).
        A tensor with no elements is returned as it is.

        Collective: every rank of the group calls it, in the same order (it creates a process
        group per set of replicas, with the group's backend: NCCL for scores on the GPU)."""
        if not isinstance(replicas, int) or replicas < 1 or self.size % replicas:
            raise ConfigError(f"replicas must divide the group's {self.size} ranks, got {replicas!r}")
        if replicas == 1:
            return lambda t: t
        sub = None
        if self.group is not None:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            for first in range(0, self.size, replicas):
                ranks = list(range(first, first + replicas))
                pg = self._run("new_group", lambda ranks=ranks: dist.new_group(ranks, timeout=timeout))
                if self.rank in ranks:
                    sub = pg

        def reduce(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == 0:
                return t
            if sub is None:
                raise TensorParallelError(
                    f"rank {self.rank}: this TPGroup has no process group (made without torch.distributed); "
                    "join one with init_tp or run_tp"
                )
            parts = [torch.empty_like(t) for _ in range(replicas)]
            self._run("all_gather of block scores", lambda: dist.all_gather(parts, t.contiguous(), group=sub))
            out = parts[0]
            for part in parts[1:]:
                out = out + part
            return out

        return reduce

    # ---------------------------------------------------------------- the control plane (gloo)
    def broadcast_object(self, obj=None, src: int = 0):
        """Rank ``src``'s ``obj`` (picklable) on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        self._run("broadcast", lambda: dist.broadcast_object_list(box, src=src, group=self.cpu_group))
        return box[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.size == 1:
            return [obj]
        out: list = [None] * self.size
        self._run("all_gather", lambda: dist.all_gather_object(out, obj, group=self.cpu_group))
        return out

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one small all-reduce)."""
        if self.size == 1:
            return bool(flag)
        t = torch.tensor([int(bool(flag))], dtype=torch.int32)
        self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group))
        return bool(t.item())

    def min(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum over the ranks of ``values`` (ints)."""
        if self.size == 1:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group))
        return [int(v) for v in t.tolist()]


def init_tp(
    rank: int | None = None,
    size: int | None = None,
    *,
    init_method: str | None = None,
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join (or, for one rank, stand in for) a tensor-parallel group.

    ``rank``/``size`` default to torchrun's ``RANK``/``WORLD_SIZE`` and ``init_method`` to
    ``env://`` (``MASTER_ADDR``/``MASTER_PORT``). ``backend``: NCCL when this rank has a GPU
    (``cuda:LOCAL_RANK``, made current), else gloo on the CPU. ``timeout_s`` bounds every
    collective (gloo and NCCL both take it at init).
    """
    env = os.environ
    rank = int(env.get("RANK", 0)) if rank is None else rank
    size = int(env.get("WORLD_SIZE", 1)) if size is None else size
    if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
        raise ConfigError(f"need 0 <= rank < size, got rank={rank!r}, size={size!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")
    local_rank = int(env.get("LOCAL_RANK", rank))
    if backend is None:
        on_gpu = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
        backend = "nccl" if on_gpu else "gloo"
    if device is None:
        device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if size == 1:
        return TPGroup(0, 1, device, timeout_s=timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method=init_method or "env://", rank=rank, world_size=size, timeout=timeout
        )
    elif dist.get_world_size() != size or dist.get_rank() != rank:
        raise ConfigError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, not rank {rank} of {size}"
        )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, size, device, dist.group.WORLD, cpu_group, timeout_s)


def shutdown_tp() -> None:
    """Leave the group (``destroy_process_group``); a no-op without one."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(conn, msg) -> None:
    """``msg`` to the parent as plain pickle bytes: ``Connection.send`` would pickle tensors with
    torch's sharing reductions, whose storage the parent fetches from this process after it has
    exited (``os._exit`` below), so the result would be lost (seen as a rank that "died with exit
    code 0")."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _tp_child(fn, rank, tp, init_method, backend, timeout_s, threads, args, conn) -> None:
    """One rank of :func:`run_tp`: join the group, run ``fn(group, *args)``, send back
    ``("ok", result)`` or ``("error", (type, message, traceback))``."""
    ok = False
    try:
        if threads:
            torch.set_num_threads(threads)
        group = init_tp(rank, tp, init_method=init_method, backend=backend, timeout_s=timeout_s)
        out = fn(group, *args)
        _send(conn, ("ok", out))
        ok = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        try:
            _send(conn, ("error", (type(e).__name__, str(e), traceback.format_exc())))
        except Exception:  # noqa: BLE001 - the parent still sees the exit code
            pass
    finally:
        conn.close()
    if not ok:
        os._exit(1)  # a broken group's teardown may block; the parent has the error
    try:
        shutdown_tp()
    finally:
        # The parent has the result: leave without the interpreter's and C++ static teardown,
        # where a still-joinable gloo thread can abort the process ("terminate called without an
        # active exception", seen in about 1 run in 5) and turn a success into a failed rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_tp(
    fn: Callable,
    tp: int = 2,
    args: Sequence = (),
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grace_s: float = DEFAULT_GRACE_S,
    threads: int | None = None,
) -> list:
    """Run ``fn(group, *args)`` on ``tp`` spawned ranks of one :class:`TPGroup`; their return
    values (picklable) in rank order.

    ``fn`` must be importable by the children (a module-level function). The ranks meet on a free
    loopback port (``backend`` as :func:`init_tp` chooses: NCCL with a GPU per rank, else gloo;
    ``threads``: torch threads per rank, default the CPU cores divided among the ranks on gloo).

    Raises :class:`~oasiskv.errors.RankFailedError` when a rank dies (killed, ``os._exit``, a
    crash) or raises: the others get ``grace_s`` seconds to report their own error (they fail as
    soon as a collective finds the peer gone), then are terminated. The error names the first
    rank that failed, its exit code, and carries every rank's traceback in ``errors``.
    """
    import multiprocessing as mp

    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be an int >= 1, got {tp!r}")
    if threads is None and backend != "nccl" and not torch.cuda.is_available():
        threads = max(1, (os.cpu_count() or 1) // tp)
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs, conns = [], {}
    try:
        for rank in range(tp):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_tp_child,
                args=(fn, rank, tp, init_method, backend, timeout_s, threads, tuple(args), send),
                name=f"oasiskv-tp-rank{rank}",
            )
            p.start()
            send.close()
            procs.append(p)
            conns[rank] = recv
        return _watch(procs, conns, grace_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def _watch(procs: list, conns: dict, grace_s: float) -> list:
    from multiprocessing.connection import wait

    tp = len(procs)
    results: dict[int, object] = {}
    raised: dict[int, tuple[str, str, str]] = {}
    exited: dict[int, int] = {}
    deadline = None

    def read(rank: int) -> None:
        c = conns[rank]
        try:
            kind, payload = pickle.loads(c.recv_bytes())  # _send's bytes
        except (EOFError, OSError):
            del conns[rank]
            return
        if kind == "ok":
            results[rank] = payload
        else:
            raised[rank] = payload

    while len(exited) < tp:
        live = [p.sentinel for r, p in enumerate(procs) if r not in exited]
        ready = wait(live + list(conns.values()), timeout=0.5)
        for rank, c in list(conns.items()):
            if c in ready:
                read(rank)
        for rank, p in enumerate(procs):
            if rank in exited or p.exitcode is None:
                continue
            while rank in conns and conns[rank].poll():  # what it sent before it exited
                read(rank)
            conns.pop(rank, None)
            exited[rank] = p.exitcode
        failed = raised.keys() | {r for r, code in exited.items() if code != 0}
        if failed and deadline is None:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            break
    died = [r for r, code in exited.items() if code != 0 and r not in raised]
    if not died and not raised:
        missing = [r for r in range(tp) if r not in results]
        if not missing:
            return [results[r] for r in range(tp)]
        died = missing
    return _raise_failed(tp, died, raised, exited, grace_s)


def _raise_failed(tp, died, raised, exited, grace_s):
    # The root cause: a rank that died without a word (the others then fail on their collectives),
    # else the first rank that raised.
    rank = died[0] if died else next(iter(raised))
    code = exited.get(rank)
    if rank in raised:
        name, msg, _ = raised[rank]
        what = f"rank {rank} of {tp} raised {name}: {msg}"
    elif code is not None and code < 0:
        what = f"rank {rank} of {tp} was killed by signal {-code}"
    else:
        what = f"rank {rank} of {tp} died (exit code {code}) without raising: os._exit or a crash"
    others = []
    for r in range(tp):
        if r == rank:
            continue
        if r in raised:
            others.append(f"rank {r} raised {raised[r][0]}: {raised[r][1]}")
        elif r not in exited:
            others.append(f"rank {r} was still running after {grace_s:g} s and was terminated")
    text = what + ("; " + "; ".join(others) if others else "")
    if rank in raised:
        text += f"\n\nrank {rank}'s traceback:\n{raised[rank][2]}"
    raise RankFailedError(text, rank, code, {r: tb for r, (_, _, tb) in raised.items()})


# ------------------------------------------------------------------------------------ the engine
def _describe(e: BaseException, rank: int) -> tuple[int, str, str, str]:
    return (rank, type(e).__module__, type(e).__name__, str(e))


def _remote_error(rank: int, module: str, name: str, msg: str) -> BaseException:
    """An exception of the class a worker raised (one of :mod:`oasiskv.errors`, or torch's OOM),
    so that the driver's LLMEngine treats it as it would its own; else TensorParallelError."""
    text = f"rank {rank}: {msg}"
    if module.startswith("torch") and name == "OutOfMemoryError":
        return torch.OutOfMemoryError(text)
    cls = getattr(_errors, name, None) if module.startswith("oasiskv") else None
    if (
        isinstance(cls, type)
        and issubclass(cls, _errors.OasisError)
        and not issubclass(cls, TensorParallelError)
    ):
        return cls(text)
    return TensorParallelError(f"{text} ({module}.{name})")


class _Driver:
    """Rank 0's :class:`~oasiskv.engine.Engine` as its LLMEngine sees it: every call that changes
    engine state or runs the model is broadcast to the workers first, then run here; the read-only
    ones (``can_admit``, ``runtime``, ``finalize_metrics``, ...) stay local.

    A call that may fail on one rank and not on another (admission growing the pools, a prefill
    chunk, the dense -> sparse transition, a decode step) ends with a status exchange; when any
    rank failed, the driver raises that error (the same class), so the LLMEngine handles it as a
    local one (finishing the request with an error, whose release then reaches every rank).
    Releases are sent with the next command (they cannot fail and need no answer).
    """

    _OWN = frozenset({"_engine", "_group", "_sent", "_deferred"})

    def __init__(self, engine, group: TPGroup) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_group", group)
        # request id -> how many of its tokens the workers hold (sent with the next command)
        object.__setattr__(self, "_sent", {})
        object.__setattr__(self, "_deferred", [])

    def __getattr__(self, name):
        if name in self._OWN:  # not set yet (copy, unpickling): no recursion through _engine
            raise AttributeError(name)
        return getattr(self._engine, name)

    def __setattr__(self, name, value) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._engine, name, value)

    def _tokens(self, r: Request) -> list[int]:
        n = self._sent.get(r.id, 0)
        self._sent[r.id] = len(r.tokens)
        return r.tokens[n:]

    def _call(self, cmd: tuple, local: Callable):
        g = self._group
        msg, self._deferred = (self._deferred, cmd), []
        g.broadcast_object(msg)
        err = out = None
        try:
            out = local()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the status exchange
            err = e
        if g.any(err is not None):
            reports = g.all_gather_object(None if err is None else _describe(err, g.rank))
            if err is not None:
                raise err
            raise _remote_error(*next(rep for rep in reports if rep is not None))
        return out

    # ---------------------------------------------------------------- mirrored calls
    def admit(self, r: Request, whole: bool = False, chunked: bool = False) -> dict | None:
        self._sent[r.id] = len(r.tokens)
        tokens = None if r.tokens == r.prompt else list(r.tokens)
        cmd = ("admit", r.id, list(r.prompt), r.max_new_tokens, tokens, whole, chunked)
        return self._call(cmd, lambda: self._engine.admit(r, whole, chunked))

    def prefill_chunk(self, r: Request, start: int, end: int):
        if start == 0 and r.runtime is None:
            # Every rank admits it alike: sparse when the engine prefills it so (whole or chunked).
            whole = end == len(r.prompt)
            r.sparse_prefill = self.admit(r, whole=whole, chunked=not whole)
        cmd = ("prefill", r.id, self._tokens(r), start, end)
        return self._call(cmd, lambda: self._engine.prefill_chunk(r, start, end))

    def prefill(self, r: Request):
        return self.prefill_chunk(r, 0, len(r.prompt))

    def decode_step(
        self, reqs: list[Request], *, speculate=None, sampling=None, verdicts=None, before_read=None
    ):
        # The sampling rows' uniforms (and forced verdicts) travel with the step: every rank draws
        # the same tokens. The drafter runs here alone, so `before_read` (its launch) stays here.
        states = [(r.id, self._tokens(r), r.draft) for r in reqs]
        spec = (speculate, sampling, verdicts)
        return self._call(
            ("decode", states, spec),
            lambda: self._engine.decode_step(
                reqs, speculate=speculate, sampling=sampling, verdicts=verdicts, before_read=before_read
            ),
        )

    def make_sparse(self, r: Request) -> None:
        self._call(("sparse", r.id, self._tokens(r)), lambda: self._engine.make_sparse(r))

    def commit_drafts(self) -> None:
        # Every rank verified the same drafts in the step (the logits are all-gathered: the same
        # bits, and the same uniforms), so the commit rides with the next command.
        self._engine.commit_drafts()
        self._deferred.append(("commit",))

    def reserve_pools(self, sizes) -> None:
        sizes = [(int(n), int(m)) for n, m in sizes]
        self._call(("reserve", sizes), lambda: self._engine.reserve_pools(sizes))

    def ensure_pools(self, requests: list[Request]) -> None:
        self.reserve_pools([(len(r.prompt), r.max_new_tokens) for r in requests])

    def release(self, r: Request) -> None:
        self._engine.release(r)
        if self._sent.pop(r.id, None) is not None:
            self._deferred.append(("release", r.id))

    def stop(self) -> None:
        msg, self._deferred = (self._deferred, ("stop",)), []
        self._group.broadcast_object(msg)


_KEEP = object()


class _Worker:
    """A worker rank's side of :class:`_Driver`: its engine, the mirrors of the driver's requests
    (tokens, draft), and the replay of each command."""

    def __init__(self, engine, group: TPGroup) -> None:
        self.engine, self.group = engine, group
        self.reqs: dict[int, Request] = {}

    def _sync(self, rid: int, tokens: list[int], draft=_KEEP) -> Request:
        """The mirror of request ``rid`` with the driver's new ``tokens`` (and ``draft``, which
        only a decode step sends)."""
        r = self.reqs[rid]
        r.tokens.extend(tokens)
        if draft is not _KEEP:
            r.draft = draft
        return r

    def apply(self, cmd: tuple) -> None:
        eng, kind = self.engine, cmd[0]
        if kind == "admit":
            _, rid, prompt, max_new, tokens, whole, chunked = cmd
            r = Request(id=rid, prompt=prompt, max_new_tokens=max_new)
            r.tokens = list(prompt if tokens is None else tokens)
            self.reqs[rid] = r
            r.sparse_prefill = eng.admit(r, whole, chunked)
        elif kind == "prefill":
            _, rid, tokens, start, end = cmd
            eng.prefill_chunk(self._sync(rid, tokens), start, end)
        elif kind == "decode":
            _, states, (speculate, sampling, verdicts) = cmd
            reqs = [self._sync(*s) for s in states]
            eng.decode_step(reqs, speculate=speculate, sampling=sampling, verdicts=verdicts)
        elif kind == "sparse":
            _, rid, tokens = cmd
            eng.make_sparse(self._sync(rid, tokens))
        elif kind == "commit":
            eng.commit_drafts()
        elif kind == "reserve":
            eng.reserve_pools(cmd[1])
        elif kind == "release":
            r = self.reqs.pop(cmd[1], None)
            if r is not None:
                eng.release(r)
        else:  # pragma: no cover - a driver of another version
            raise TensorParallelError(f"rank {self.group.rank}: unknown engine command {kind!r}")

    def loop(self) -> None:
        g = self.group
        while True:
            deferred, cmd = g.broadcast_object(None)
            for c in deferred:
                self.apply(c)
            if cmd[0] == "stop":
                for r in self.reqs.values():
                    self.engine.release(r)
                self.reqs.clear()
                return
            err = None
            try:
                self.apply(cmd)
            except Exception as e:  # noqa: BLE001 - reported to the driver, which decides
                err = e
            g.check()
            if g.any(err is not None):
                g.all_gather_object(None if err is None else _describe(err, g.rank))


#: LLMEngine options a tensor-parallel engine does not take yet, and why.
_TP_UNSUPPORTED = {
    "policy": "selection policies (evaluation) run on one rank",
    "cuda_graph": "captured steps with the group's collectives inside are not done yet",
    "kv_source": "a staged request's KV would come from the daemon on the driver only",
}


class TPLLMEngine:
    """An :class:`~oasiskv.LLMEngine` over one rank's shard of a tensor-parallel model.

    Build one on every rank of ``group`` with the same arguments (``model``: this rank's
    :class:`~oasiskv.models.tp.TPCausalLM`; the rest as :class:`~oasiskv.LLMEngine` takes
    them). Rank 0 is the *driver*: call ``add_request``, ``step``, ``abort_request``,
    ``run_to_completion`` ... there, as on an LLMEngine, and :meth:`shutdown` at the end. The
    other ranks call :meth:`worker_loop`, which returns when the driver shuts down. One engine
    per group at a time (the ranks' commands share the group's control channel).

    **What each rank owns.** Its engine (:attr:`engine`) holds the pools, block tables,
    summaries, head-wise mapping and selection of its ``num_key_value_heads / tp`` KV heads (one,
    shared with the other replicas of that head, when ``tp`` exceeds them: the engine then sums its
    block scores over the replicas, ``Engine.score_reduce``); the runtime of every rank plans the
    same steps (same geometry, same caps).

    **What is decided once.** Admission, which requests prefill and decode in a step, sampling,
    the drafter's lookahead tokens and the dense -> sparse transitions are the driver's
    LLMEngine's; the workers receive its engine calls (with each request's new tokens and draft)
    and replay them in order. So the ranks never diverge, and only the driver runs a drafter
    (the n-gram drafter; EAGLE-3 needs the sharded LM head and is not supported yet).

    **Prefill cache.** Pass each rank its own :class:`~oasiskv.engine.PrefillCache` (it holds
    that rank's shard of each prompt's KV); a prompt is served from the caches only when every
    rank's hits, else every rank runs the forward.

    **Budgets** (``gpu_kv_budget_bytes``, ``host_kv_budget_bytes``) are per rank. Left out, each
    rank takes its share of the defaults (the host pool's 40 % of free RAM is divided among the
    ranks of the host, and so are the pages on the CPU) and all ranks use the smallest.

    **Failures.** A call that fails on some ranks (an admission or a prefill out of memory, a
    transition) fails on the driver with the same error class, which the LLMEngine handles as
    usual (that request ends with an error). A rank that dies makes every other rank's next
    collective raise :class:`~oasiskv.errors.TensorParallelError` (also ``step`` and
    ``run_to_completion`` on the driver, even where the LLMEngine had turned it into per-request
    errors); a rank that fails inside a forward leaves the others waiting in a collective until
    the group's timeout, then the same.

    Metrics (bytes fetched, lookahead recall, resident bytes) are the driver's, i.e. of its
    own KV heads.
    """

    def __init__(self, model, group: TPGroup | None = None, **kwargs) -> None:
        from .llm_engine import LLMEngine
        from .models.tp import TPCausalLM

        # A TPCausalLM names its rank and group; any other EngineModel is the whole model.
        sharded = isinstance(model, TPCausalLM)
        if group is None:
            group = model.group if sharded else TPGroup.single(next(model.parameters()).device)
        if not isinstance(group, TPGroup):
            raise ConfigError(f"group must be a TPGroup, got {type(group).__name__}")
        tp = group.size
        shard = (model.tp_rank, model.tp_size) if sharded else (0, 1)
        if shard != (group.rank, tp):
            raise ConfigError(
                f"model is shard {shard[0]} of {shard[1]} but this is rank {group.rank} of {tp}; pass "
                "this rank's TPCausalLM (TPCausalLM.from_full(model, group) or TPCausalLM.random)"
            )
        if tp > 1:
            _check_tp_options(kwargs)
            # CUDA graphs (the LLMEngine default on a GPU) cannot hold the group's collectives yet.
            kwargs = {**kwargs, "enforce_eager": True}
        self.group = group
        llm = LLMEngine(model, **kwargs)
        if tp > 1:
            llm = self._agree_budgets(llm, model, kwargs)
            # A prefill cache (one per rank, of its own shard) serves a prompt only where every
            # rank has it: a hit skips the forward, whose collectives the others would wait in.
            llm.engine.prefill_agree = lambda hit: not group.any(not hit)
        self._llm = llm
        #: This rank's own engine (its KV heads' pools, tables and selection).
        self.engine = llm.engine
        self._driver: _Driver | None = None
        self._worker: _Worker | None = None
        self._closed = False
        if tp > 1 and group.rank == 0:
            self._driver = _Driver(llm.engine, group)
            llm.engine = self._driver
        elif tp > 1:
            self._worker = _Worker(llm.engine, group)

    def _agree_budgets(self, llm, model, kwargs):
        from .llm_engine import LLMEngine

        # The caps a budget left out would take are read from the free memory when the runtime is
        # made, at a different moment on each rank: fix them now, the same on every rank.
        g = self.group
        if kwargs.get("gpu_kv_budget_bytes") is not None and kwargs.get("host_kv_budget_bytes") is not None:
            return llm
        eng = llm.engine
        gpu, host = eng.default_caps()
        if kwargs.get("host_kv_budget_bytes") is None and eng.kv.num_host_blocks is None:
            host //= g.size  # one host's RAM holds every rank's host pool
        on_cpu = eng.device.type == "cpu"
        if on_cpu and kwargs.get("gpu_kv_budget_bytes") is None and eng.kv.num_gpu_pages is None:
            gpu //= g.size  # and on the CPU the pages too
        gpu, host = g.min([gpu, host])
        per, per_row = eng.page_bytes_all_layers, eng.host_row_bytes_all_layers
        budgets = {"gpu_kv_budget_bytes": gpu * per, "host_kv_budget_bytes": host * per_row}
        return LLMEngine(model, **{**kwargs, **{k: v for k, v in budgets.items() if kwargs.get(k) is None}})

    # ---------------------------------------------------------------- roles
    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def is_driver(self) -> bool:
        """Whether this rank schedules (rank 0)."""
        return self.group.rank == 0

    def _need_driver(self, what: str) -> None:
        if not self.is_driver:
            raise ConfigError(
                f"{what} is the driver's (rank 0); rank {self.rank} is a worker: call worker_loop()"
            )

    def worker_loop(self) -> None:
        """(Workers) Replay the driver's engine calls until it calls :meth:`shutdown`. Raises
        :class:`~oasiskv.errors.TensorParallelError` when the group breaks."""
        if self.is_driver:
            raise ConfigError("worker_loop() is for ranks > 0; rank 0 drives (add_request, step, ...)")
        if self._worker is not None:
            self._worker.loop()

    def shutdown(self) -> None:
        """(Driver) Let the workers' :meth:`worker_loop` return. Safe to call twice, and after the
        group broke (then nothing is sent)."""
        self._need_driver("shutdown()")
        if self._driver is not None and not self._closed and self.group.broken is None:
            self._closed = True
            self._driver.stop()

    # ---------------------------------------------------------------- the driver's LLMEngine
    def add_request(self, *args, **kwargs) -> str:
        self._need_driver("add_request()")
        return self._llm.add_request(*args, **kwargs)

    def abort_request(self, request_id: str) -> None:
        self._need_driver("abort_request()")
        self._llm.abort_request(request_id)

    def reserve_pools(self, sizes: list[tuple[int, int]]) -> None:
        """:meth:`oasiskv.LLMEngine.reserve_pools` on every rank (the driver's engine tells them)."""
        self._need_driver("reserve_pools()")
        self._llm.reserve_pools(sizes)

    def step(self):
        """:meth:`oasiskv.LLMEngine.step` on the driver; raises the group's error if it broke."""
        self._need_driver("step()")
        if self._closed:
            raise ConfigError("this TPLLMEngine was shut down; build a new one")
        out = self._llm.step()
        self.group.check()
        return out

    def run_to_completion(self, request_ids: list[str], progress=None):
        self._need_driver("run_to_completion()")
        out = self._llm.run_to_completion(request_ids, progress)
        self.group.check()
        return out

    def __getattr__(self, name):
        # has_unfinished_requests, num_waiting, result, spec_stats, tokenizer, model, kv, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._llm, name)


def _check_tp_options(kwargs: dict) -> None:
    from .drafters import Eagle3Drafter

    drafter = kwargs.get("drafter", "ngram")
    if drafter == "eagle3" or isinstance(drafter, Eagle3Drafter):
        raise NotImplementedError(
            "the EAGLE-3 drafter with tp > 1 is not done yet (its head reads the target's embedding and "
            "LM head, which are split across the ranks); use drafter='ngram' or 'previous-query'"
        )
    for name, why in _TP_UNSUPPORTED.items():
        if kwargs.get(name):
            raise ConfigError(f"{name} is not supported with tp > 1 yet ({why}); leave it out")
