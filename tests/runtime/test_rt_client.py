"""``oasiskv._core.RtClient`` against the real ``oasis-rt`` daemon (its own process): bytes in and
out bit-exact, the protocol's byte counts, typed errors with a code, deadlines, the token.

Every daemon test runs over TCP (``oasis-rt://``) and UCX (``oasis-rt+ucx://``, marker ``ucx``:
``make test-ucx``, where a missing libucp fails). A UCX address where libucp cannot be loaded
raises a typed error, tested everywhere (a child process pointed at no library)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from oasiskv import disagg, errors
from oasiskv._core import RtClient, ucx_version
from support.rtd import TRANSPORTS, Daemon

# Private names read here: ``RtClient``/``ucx_version`` from ``oasiskv._core``: the native client is
# what this file checks (no public re-export).

# (num_layers, num_kv_heads, block_size, head_dim, dtype_bytes, num_blocks, kv_format); odd sizes,
# plain blocks of float32.
GEO = (3, 2, 5, 6, 4, 7, 0)
BLOCK = 2 * 2 * 5 * 6 * 4
ROW = 2 * 2 * 6 * 4


@pytest.fixture(scope="module", params=TRANSPORTS)
def daemon(request):
    with Daemon(transport=request.param) as d:
        yield d


def _blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, BLOCK // 4, generator=g)


def _reads_into_pools(c, data: torch.Tensor) -> None:
    """``read_blocks_into`` (request 11 of GEO staged with ``data``): each entry lands in its row
    (and head) of its layer's pools, bit-exact; nothing else is written; failures write nothing."""
    layers, heads, bs, hd = GEO[:4]
    pools_k = [torch.full((4, heads, bs, hd), -1.0) for _ in range(layers)]
    pools_v = [torch.full((4, heads, bs, hd), -1.0) for _ in range(layers)]
    keys = [(11, 1, 2, -1), (11, 2, 4, 1), (12, 0, 0, -1), (11, 0, 5, 0), (11, 0, 99, 1)]
    rows = [3, 0, 1, 0, 2]
    lens, errs = c.read_blocks_into(keys, rows, pools_k, pools_v)
    assert errs == [None, None, "unknown_request", None, "bad_request"]  # block 99 of 7
    assert lens == [BLOCK, BLOCK // 2, 0, BLOCK // 2, 0]
    want_k = [torch.full((4, heads, bs, hd), -1.0) for _ in range(layers)]
    want_v = [torch.full((4, heads, bs, hd), -1.0) for _ in range(layers)]
    blk = data[7 + 2].view(2, heads, bs, hd)  # layer 1, block 2, whole: [K|V][head]
    want_k[1][3], want_v[1][3] = blk[0], blk[1]
    blk = data[14 + 4].view(2, heads, bs, hd)  # layer 2, block 4, head 1
    want_k[2][0, 1], want_v[2][0, 1] = blk[0, 1], blk[1, 1]
    blk = data[5].view(2, heads, bs, hd)  # layer 0, block 5, head 0
    want_k[0][0, 0], want_v[0][0, 0] = blk[0, 0], blk[1, 0]
    for got, want in zip(pools_k + pools_v, want_k + want_v, strict=True):
        assert torch.equal(got, want)

    # Pools of another geometry: the entries do not fit, so they fail and write nothing.
    small = [torch.zeros(4, heads, bs, hd - 1) for _ in range(layers)]
    _, errs = c.read_blocks_into([(11, 0, 0, 0)], [0], small, small)
    assert errs == ["size_mismatch"] and all(not t.any() for t in small)
    # Bad arguments are refused before anything is read.
    for call, exc in [
        (lambda: c.read_blocks_into([(11, 0, 0, 0)], [4], pools_k, pools_v), errors.InvalidArgumentError),
        (lambda: c.read_blocks_into([(11, 0, 0, 0)], [-1], pools_k, pools_v), errors.InvalidArgumentError),
        (lambda: c.read_blocks_into([(11, 0, 0, 2)], [0], pools_k, pools_v), errors.InvalidArgumentError),
        (lambda: c.read_blocks_into([(11, 3, 0, 0)], [0], pools_k, pools_v), errors.InvalidArgumentError),
        (lambda: c.read_blocks_into([(11, 0, 0, 0)], [0, 1], pools_k, pools_v), errors.InvalidArgumentError),
        (lambda: c.read_blocks_into([(11, 0, 0, 0)], [0], pools_k, pools_v[:1]), errors.InvalidArgumentError),
        (
            lambda: c.read_blocks_into([(11, 0, 0, 0)], [0], [p.transpose(1, 2) for p in pools_k], pools_v),
            errors.ShapeError,
        ),
        (
            lambda: c.read_blocks_into([(11, 0, 0, 0)], [0], [p[:, :1] for p in pools_k], pools_v),
            errors.ShapeError,
        ),
        (
            lambda: c.read_blocks_into([(11, 0, 0, 0)], [0], [p.double() for p in pools_k], pools_v),
            errors.DTypeError,
        ),
    ]:
        with pytest.raises(exc):
            call()


def test_roundtrip_is_bit_exact_and_counted(daemon):
    c = RtClient(daemon.url, timeout_s=5)
    assert (c.transport, c.url, c.addr) == (daemon.transport, daemon.url, daemon.addr)
    assert c.rma == (daemon.transport == "ucx")  # block reads by RMA over UCX
    keys = [(layer, b) for layer in range(3) for b in range(7)]
    data = _blocks(len(keys), 0)
    stored, used = c.stage_blocks(11, GEO, keys, data)
    assert stored >= data.numel() * 4 and used >= stored
    rows = torch.randn(3 * 7, ROW // 4)
    c.stage_summaries(11, GEO, [(layer, 0, 7) for layer in range(3)], rows.numpy().tobytes())
    query = torch.randn(3, 4, 6, dtype=torch.bfloat16)
    c.stage_admission(11, [(0, 6), (2, 1), (2, 3)], {"oasis/meta": b'{"x": 1}', "oasis/query": query})

    before = c.wire_bytes
    a = c.fetch_admission(11, 0, 3)
    after = c.wire_bytes
    assert a["geometry"] == GEO
    assert a["summary_runs"] == [(layer, 0, 7) for layer in range(3)]
    assert torch.equal(torch.frombuffer(a["summaries"], dtype=torch.float32).view(21, -1), rows)
    assert a["block_keys"] == [(0, 6), (2, 1), (2, 3)]
    got = torch.frombuffer(a["blocks"], dtype=torch.float32).view(3, -1)
    assert torch.equal(got, data[[6, 14 + 1, 14 + 3]])
    q = torch.frombuffer(bytearray(a["sections"]["oasis/query"]), dtype=torch.bfloat16)
    assert torch.equal(q, query.view(-1))
    # The reply's bytes as the protocol lays them out: prefix + header, geometry, runs, blocks,
    # sections.
    runs = 4 + 3 * (10 + 7 * ROW)
    blocks = 4 + 3 * (6 + BLOCK)
    sections = 1 + (1 + 10 + 4 + 8) + (1 + 11 + 4 + query.numel() * 2)
    assert a["wire_bytes"] == 12 + 14 + runs + blocks + sections  # geometry: 14 bytes
    assert after[1] - before[1] == a["wire_bytes"] and after[0] - before[0] == 12 + 13

    # No layers: the sections alone.
    only = c.fetch_admission(11, 0, 0)
    assert only["summary_runs"] == [] and only["block_keys"] == [] and len(only["blocks"]) == 0
    assert set(only["sections"]) == {"oasis/meta", "oasis/query"}

    # Reads: whole blocks, one head (K rows then V rows), per-entry failures.
    d, lens, errs = c.read_blocks([(11, 1, 2, -1), (11, 2, 4, 1), (12, 0, 0, -1), (11, 0, 0, 0)])
    assert errs == [None, None, "unknown_request", None]
    assert lens == [BLOCK, BLOCK // 2, 0, BLOCK // 2]
    x = torch.frombuffer(d, dtype=torch.float32)
    assert torch.equal(x[: BLOCK // 4], data[7 + 2])
    blk = data[14 + 4].view(2, 2, -1)  # [K|V][head][rows]
    assert torch.equal(x[BLOCK // 4 : BLOCK // 4 + BLOCK // 8], torch.cat([blk[0, 1], blk[1, 1]]))

    # Over UCX the reads above went by RMA; by frames the answer is the same.
    frames = RtClient(daemon.url, timeout_s=5, rma=False)
    assert not frames.rma
    keys = [(11, 1, 2, -1), (11, 2, 4, 1), (12, 0, 0, -1), (11, 0, 0, 0), (11, 0, 99, -1)]
    assert frames.read_blocks(keys) == c.read_blocks(keys)
    frames.close()

    _reads_into_pools(c, data)

    s = c.stats()
    assert s["live_requests"] >= 1 and s["used_bytes"] >= used
    assert c.release(11) >= used
    assert c.release(11) == 0  # idempotent
    c.close()
    assert not c.connected


# An fp8 geometry (kv_format 1) of bf16 summaries: each head segment is 5 x 6 codes and a scale.
GEO8 = (2, 2, 5, 6, 2, 4, 1)
SEG8 = 5 * 6 + 4
BLOCK8 = 2 * 2 * SEG8


def test_fp8_blocks_land_as_codes_and_scales(daemon):
    """A request staged with fp8 blocks: whole blocks and block-heads are read into uint8 pools
    and their float32 scales, bit-exact (``read_blocks_into`` with ``host_k_scales``), as
    ``disagg.unpack_kv8`` reads them from bytes; mismatched pools are refused or fail per entry."""
    c = RtClient(daemon.url, timeout_s=5)
    layers, heads, bs, hd, _, nb, _ = GEO8
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 255, (2, layers * nb, heads, bs, hd), dtype=torch.uint8, generator=g)
    scales = torch.exp2(torch.randint(-9, 3, (2, layers * nb, heads), generator=g).float())
    data = disagg.pack_kv8(codes[0], scales[0], codes[1], scales[1])
    assert data.shape == (layers * nb, 2, heads, SEG8) and data[0].numel() == BLOCK8
    assert disagg.block_bytes(GEO8) == BLOCK8 and disagg.head_segment_bytes(GEO8) == SEG8
    c.stage_blocks(31, GEO8, [(layer, b) for layer in range(layers) for b in range(nb)], data)
    assert c.fetch_admission(31, 0, 0)["geometry"] == GEO8

    keys = [(31, 1, 2, -1), (31, 0, 3, 1), (31, 1, 0, 0)]
    rows = [2, 0, 1]
    d, lens, errs = c.read_blocks(keys)
    assert errs == [None] * 3 and lens == [BLOCK8, 2 * SEG8, 2 * SEG8]
    k, v, ks, vs = disagg.unpack_kv8(bytearray(d[:BLOCK8]), 1, heads, bs, hd)
    i = nb + 2  # layer 1, block 2
    assert torch.equal(k[0], codes[0, i]) and torch.equal(v[0], codes[1, i])
    assert torch.equal(ks[0], scales[0, i]) and torch.equal(vs[0], scales[1, i])

    pk = [torch.zeros(3, heads, bs, hd, dtype=torch.uint8) for _ in range(layers)]
    pv = [torch.zeros(3, heads, bs, hd, dtype=torch.uint8) for _ in range(layers)]
    sk = [torch.zeros(3, heads) for _ in range(layers)]
    sv = [torch.zeros(3, heads) for _ in range(layers)]
    lens, errs = c.read_blocks_into(keys, rows, pk, pv, sk, sv)
    assert errs == [None] * 3 and lens == [BLOCK8, 2 * SEG8, 2 * SEG8]
    want = [[torch.zeros_like(t) for t in ts] for ts in (pk, pv, sk, sv)]
    for (_, layer, blk, head), row in zip(keys, rows, strict=True):
        at = (row,) if head == -1 else (row, head)
        src = (blk + nb * layer,) if head == -1 else (blk + nb * layer, head)
        for w, x in zip(want, (codes[0], codes[1], scales[0], scales[1]), strict=True):
            w[layer][at] = x[src]
    for got, w in zip((pk, pv, sk, sv), want, strict=True):
        for a, b in zip(got, w, strict=True):
            assert torch.equal(a, b)

    # Plain pools of another width take nothing of an fp8 entry; float pools get no scales.
    plain = [torch.zeros(3, heads, bs, hd, dtype=torch.bfloat16) for _ in range(layers)]
    assert c.read_blocks_into(keys[:1], [0], plain, plain)[1] == ["size_mismatch"]
    assert not any(t.any() for t in plain)
    for call, exc in [
        (lambda: c.read_blocks_into(keys[:1], [0], plain, plain, sk, sv), errors.DTypeError),
        (lambda: c.read_blocks_into(keys[:1], [0], pk, pv, sk, None), errors.InvalidArgumentError),
        (lambda: c.read_blocks_into(keys[:1], [0], pk, pv, sk[:1], sv), errors.InvalidArgumentError),
        (lambda: c.read_blocks_into(keys[:1], [0], pk, pv, [s[:, :1] for s in sk], sv), errors.ShapeError),
        (lambda: c.read_blocks_into(keys[:1], [0], pk, pv, [s.double() for s in sk], sv), errors.DTypeError),
    ]:
        with pytest.raises(exc):
            call()
    # The same request under a plain geometry is another request's shape: refused.
    with pytest.raises(errors.OasisError, match="geometry"):
        c.stage_blocks(
            31, GEO8[:-1] + (0,), [(0, 0)], torch.zeros(2 * heads * bs * hd * 2, dtype=torch.uint8)
        )
    assert c.release(31) > 0
    c.close()


def test_large_stagings_are_split_into_frames(daemon):
    c = RtClient(daemon.url, timeout_s=10, max_frame=64 << 10)
    assert c.max_frame == 64 << 10
    geo = (1, 2, 16, 64, 2, 300, 0)  # 8 KiB blocks: 7 per 64 KiB frame
    bb = 2 * 2 * 16 * 64 * 2
    data = torch.randint(0, 255, (300, bb), dtype=torch.uint8)
    c.stage_blocks(21, geo, [(0, i) for i in range(300)], data)
    c.stage_summaries(21, geo, [(0, 0, 300)], torch.zeros(300, 2 * 2 * 64 * 2, dtype=torch.uint8))
    d, lens, errs = c.read_blocks([(21, 0, i, -1) for i in (0, 150, 299)])
    assert errs == [None] * 3
    assert torch.equal(torch.frombuffer(d, dtype=torch.uint8).view(3, bb), data[[0, 150, 299]])
    # A reply past the client's frame limit: refused, and over TCP the connection with it (the
    # daemon does not know the client's limit; readers batch under max_frame). By RMA the
    # client sees the sizes before any byte moves: it acknowledges and keeps the connection.
    with pytest.raises(errors.InvalidArgumentError) as e:
        c.read_blocks([(21, 0, i, -1) for i in range(20)])
    assert e.value.code == "too_large"
    assert c.connected == c.rma == (daemon.transport == "ucx")
    assert ("make a new RtClient" in str(e.value)) != c.connected
    assert RtClient(daemon.url).release(21) > 300 * bb


def test_mistakes_are_typed_and_keep_the_connection(daemon):
    c = RtClient(daemon.url, timeout_s=5)
    with pytest.raises(errors.RemoteNotFoundError) as e:
        c.fetch_admission(999, 0, 1)
    assert e.value.code == "unknown_request" and "stage it again" in str(e.value)
    with pytest.raises(errors.InvalidArgumentError, match="one block per key"):
        c.stage_blocks(5, GEO, [(0, 0)], b"\0" * 3)
    with pytest.raises(errors.InvalidArgumentError):
        c.stage_blocks(5, (0, 2, 5, 6, 4, 7, 0), [], b"")  # zero layers
    with pytest.raises(errors.InvalidArgumentError, match="kv_format"):
        c.stage_blocks(5, GEO[:-1] + (2,), [], b"")  # no such block format
    with pytest.raises(errors.InvalidArgumentError, match="kv_format"):
        c.stage_blocks(5, (3, 2, 5, 6, 1, 7, 1), [], b"")  # fp8 codes over a 1-byte model dtype
    with pytest.raises(errors.InvalidArgumentError):
        c.stage_blocks(5, GEO, [(9, 0)], _blocks(1, 1))  # layer out of range
    with pytest.raises(errors.InvalidArgumentError, match="neither -1"):
        c.read_blocks([(5, 0, 0, -2)])
    with pytest.raises(errors.DTypeError):
        c.stage_blocks(5, GEO, [(0, 0)], 3.5)
    with pytest.raises(errors.ConfigError):
        RtClient(daemon.url, timeout_s=0)
    assert c.connected  # none of these broke it
    c.close()
    with pytest.raises(errors.RemoteUnavailableError):
        c.stats()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unreachable_daemon(transport):
    with Daemon(transport=transport) as d:
        url = d.url
    t = time.monotonic()
    with pytest.raises(errors.RemoteUnavailableError) as e:
        RtClient(url, timeout_s=2, connect_timeout_s=2)
    assert e.value.code == "unreachable" and "oasis-rt serve" in str(e.value)
    assert ("--transport ucx" in str(e.value)) == (transport == "ucx")
    assert isinstance(e.value, ConnectionError) and time.monotonic() - t < 5


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_without_the_token_is_refused(transport):
    with Daemon(token="correct horse", transport=transport) as d:
        for token in (None, "battery staple"):
            with pytest.raises(errors.RemoteAuthError) as e:
                RtClient(d.url, token=token, timeout_s=5)
            assert e.value.code == "unauthorized" and "token" in str(e.value)
            assert isinstance(e.value, PermissionError)
        c = RtClient(d.url, token=b"correct horse\n", timeout_s=5)
        assert c.stats()["live_requests"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stalled_daemon_times_out(transport):
    with Daemon(transport=transport) as d:
        c = RtClient(d.url, timeout_s=1)
        d.stop()
        t = time.monotonic()
        with pytest.raises(errors.RemoteTimeoutError) as e:
            c.stats()
        took = time.monotonic() - t
        assert e.value.code == "timeout" and isinstance(e.value, TimeoutError)
        assert 0.9 < took < 3, took
        assert not c.connected
        with pytest.raises(errors.RemoteUnavailableError):  # fails at once afterwards
            c.stats()
        d.cont()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killing_the_daemon_mid_transfer_gives_a_typed_error_in_time(transport):
    with Daemon(memory="1GiB", transport=transport) as d:
        c = RtClient(d.url, timeout_s=5)
        geo = (1, 8, 64, 128, 2, 512, 0)  # 256 KiB blocks, 128 MiB staged
        bb = 2 * 8 * 64 * 128 * 2
        for lo in range(0, 512, 128):
            zeros = torch.zeros(128, bb, dtype=torch.uint8)
            c.stage_blocks(3, geo, [(0, i) for i in range(lo, lo + 128)], zeros)
        reader = RtClient(d.url, timeout_s=5)
        keys = [(3, 0, i, -1) for i in range(200)]  # ~50 MiB replies
        caught: list = []
        calls = [0]

        def read_forever():
            try:
                while True:
                    reader.read_blocks(keys)
                    calls[0] += 1
            except errors.OasisError as e:
                caught.append((e, time.monotonic()))

        th = threading.Thread(target=read_forever, daemon=True)
        th.start()
        while calls[0] == 0:  # at least one whole reply, so the next ones are mid-transfer
            time.sleep(0.005)
        time.sleep(0.03)
        killed = time.monotonic()
        d.kill()
        th.join(timeout=10)
        assert not th.is_alive(), "the reader hangs"
        ((err, when),) = caught
        assert isinstance(err, errors.RemoteUnavailableError), err
        assert err.code in ("closed", "unreachable")
        assert when - killed < 5


def test_addresses_name_the_transport(daemon):
    # The same daemon by its bare address and by its URL (TCP), refused schemes typed.
    if daemon.transport == "tcp":
        for addr in (daemon.addr, daemon.url):
            c = RtClient(addr, timeout_s=5)
            assert c.transport == "tcp" and c.url == daemon.url and c.stats()["live_requests"] >= 0
    for bad in ("oasis-rt+tcp://" + daemon.addr, "http://" + daemon.addr, "oasis-rt://nohost"):
        with pytest.raises(errors.ConfigError) as e:
            RtClient(bad)
        assert e.value.code == "bad_address" and "oasis-rt+ucx://" in str(e.value)


@pytest.mark.ucx
@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_a_transport_mismatch_fails_in_time(transport):
    # A client of the other transport: refused or timed out within its deadline, typed. (Either
    # way one side needs UCX: the marker is on both.)
    other = "oasis-rt://" if transport == "ucx" else "oasis-rt+ucx://"
    with Daemon(transport=transport) as d:
        t = time.monotonic()
        with pytest.raises(errors.RemoteError):
            RtClient(other + d.addr, timeout_s=2, connect_timeout_s=2)
        assert time.monotonic() - t < 5
        assert RtClient(d.url, timeout_s=5).stats()["live_requests"] == 0  # it still serves


def test_ucx_without_libucp_is_a_typed_error():
    # In a child process pointed at no library (libucp is loaded once per process).
    code = """
from oasiskv import disagg, errors
from oasiskv._core import RtClient, ucx_version
for f in (ucx_version, lambda: RtClient("oasis-rt+ucx://127.0.0.1:9")):
    try:
        f()
    except errors.ConfigError as e:
        print(e.code, "|", e)
c = RtClient.__name__  # the module imported and TCP clients are unaffected
"""
    env = dict(os.environ, OASIS_UCP_LIB="/nonexistent/libucp.so.0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    for line in lines:
        code_name, msg = line.split(" | ", 1)
        assert code_name == "ucx_unavailable"
        assert "cannot load libucp" in msg and "apt-get install libucx0" in msg and "OASIS_UCP_LIB" in msg
        assert "oasis-rt://" in msg  # the TCP way out


@pytest.mark.ucx
def test_a_forked_child_is_refused_ucx_and_keeps_tcp():
    # UCX is not fork-safe (a forked child's connections hang, its teardown aborts): a child
    # forked after the parent's first UCX client gets the typed error, and TCP still works.
    with Daemon(transport="ucx") as u, Daemon() as t:
        code = f"""
import os, sys
from oasiskv import disagg, errors
from oasiskv._core import RtClient
c = RtClient("{u.url}", timeout_s=5)
c.stats()
pid = os.fork()
if pid == 0:
    try:
        RtClient("{u.url}", timeout_s=5)
        os._exit(3)
    except errors.ConfigError as e:
        assert e.code == "ucx_unavailable" and "fork" in str(e), e
    RtClient("{t.url}", timeout_s=5).stats()
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
c.stats()
print("ok")
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.ucx
def test_libucp_loads():
    # Under make test-ucx a machine without UCX fails here first, with the reason.
    major, minor, _ = ucx_version()
    assert (major, minor) >= (1, 10)
