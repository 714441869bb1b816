"""``oasiskv._core.Coordinator`` (crate ``oasis-coord``) against the real ``oasis-rt`` daemon: a
block-head read lands bit-exact in the registered pool (plain and fp8 with its scales) and only
then counts as present; a released request fails alone with its message; the caller's mistakes
are typed errors that say what to pass. The coordinator's own state machine is tested in Rust
(``crates/oasis-coord/tests``: in-flight layers, broken connections, a plain model)."""

from __future__ import annotations

import pytest
import torch

from oasiskv import errors
from oasiskv._core import Coordinator, RtClient
from support.rtd import Daemon

# Private names read here: ``Coordinator``/``RtClient`` from ``oasiskv._core``: the native
# coordinator is what this file checks (no public re-export).

# (num_layers, num_kv_heads, block_size, head_dim, dtype_bytes, num_blocks, kv_format): odd sizes.
LAYERS, HEADS, B, D, NB = 3, 2, 5, 6, 4
ROWS = 7


def _stage(c: RtClient, rid: int, kv_format: int) -> torch.Tensor:
    """Stage every block of ``rid``; their bytes ``[layers, blocks, block_bytes]``."""
    elem = 1 if kv_format else 4
    seg = B * D * elem + (4 if kv_format else 0)  # a head's rows (fp8: then its scale)
    block = 2 * HEADS * seg
    g = torch.Generator().manual_seed(rid)
    data = torch.randint(0, 120, (LAYERS, NB, block), dtype=torch.uint8, generator=g)
    if kv_format:  # scales: finite float32 values
        view = data.view(LAYERS, NB, 2 * HEADS, seg)
        view[..., B * D :] = torch.full((LAYERS, NB, 2 * HEADS, 1), 0.5).view(torch.uint8)
    geo = (LAYERS, HEADS, B, D, 4, NB, kv_format)  # dtype_bytes: the model's (float32); fp8 codes are 1
    for layer in range(LAYERS):
        c.stage_blocks(rid, geo, [(layer, i) for i in range(NB)], data[layer].contiguous())
    return data


def _pools(kv_format: int):
    dt = torch.uint8 if kv_format else torch.float32
    k = [torch.zeros(ROWS, HEADS, B, D, dtype=dt) for _ in range(LAYERS)]
    v = [torch.zeros(ROWS, HEADS, B, D, dtype=dt) for _ in range(LAYERS)]
    if not kv_format:
        return k, v, []
    return k, v, [[torch.zeros(ROWS, HEADS) for _ in range(LAYERS)] for _ in range(2)]


@pytest.mark.parametrize("kv_format", [0, 1], ids=["plain", "fp8"])
def test_a_read_lands_bit_exact_and_only_then_is_present(kv_format):
    with Daemon() as d:
        c = RtClient(d.url)
        data = _stage(c, 11, kv_format)
        co = Coordinator(d.url, LAYERS, HEADS, connections=2)
        k, v, scales = _pools(kv_format)
        co.register_pools(k, v, *scales)
        assert co.rows == ROWS
        co.stage(1, 11)
        for logical, row in enumerate((2, 5)):
            co.take_row(row, 1, logical)
        assert co.missing == 2 * LAYERS * HEADS
        assert not co.is_present(1, 5, 1)
        # Head 1 of row 5 (logical 1) in layer 1; every head of row 2 (logical 0) in layer 2.
        sent = co.submit([1, 2, 1], [5, 2, 5], [1, -1, 1])
        assert sent == [0, 1, 2]
        co.wait_layer(1)
        assert co.is_present(1, 5, 1) and not co.is_present(1, 5, 0)
        co.drain()
        elem = 1 if kv_format else 4
        seg = B * D * elem + (4 if kv_format else 0)
        for layer, row, logical, head in [(1, 5, 1, 1), (2, 2, 0, 0), (2, 2, 0, 1)]:
            staged = data[layer, logical].view(2, HEADS, seg)
            for side, pool in enumerate((k, v)):
                got = pool[layer][row, head].contiguous().view(torch.uint8).flatten()
                assert torch.equal(got, staged[side, head, : B * D * elem])
                if kv_format:
                    want = staged[side, head, B * D * elem :].clone().view(torch.float32)
                    assert scales[side][layer][row, head] == want[0]
        assert torch.count_nonzero(k[1][5, 0]) == 0  # only the head read
        assert co.missing == 2 * LAYERS * HEADS - 3
        s = co.stats()
        assert s["sent_entries"] == s["entries"] == 3 and s["wire_bytes"] > 0
        assert co.take_landed() == {1: (3, s["wire_bytes"])}
        assert co.end(1, [2, 5]) == 3 and co.missing == 0
        co.close()
        with pytest.raises(errors.RemoteUnavailableError, match="closed"):
            co.submit([0], [2], [0])
        c.close()


def test_a_released_request_fails_alone():
    with Daemon() as d:
        c = RtClient(d.url)
        _stage(c, 11, 0)
        _stage(c, 12, 0)
        c.release(12)
        co = Coordinator(d.url, LAYERS, HEADS)
        k, v, _ = _pools(0)
        co.register_pools(k, v)
        co.stage(1, 11)
        co.stage(2, 12)
        co.take_row(0, 1, 0)
        co.take_row(1, 2, 0)
        co.submit([0, 0], [0, 1], [0, 0])
        co.drain()
        failed = co.take_failed()
        assert list(failed) == [2] and "unknown_request" in failed[2]
        assert co.is_present(0, 0, 0) and not co.is_present(0, 1, 0)
        assert co.submit([1], [1], [0]) == [0, 0, 0]  # a failed request is not read again
        co.close()
        c.close()


def test_mistakes_are_typed_errors_that_say_what_to_pass():
    co = Coordinator("oasis-rt://127.0.0.1:9", LAYERS, HEADS)  # connects on the first read
    with pytest.raises(errors.InvalidArgumentError, match="register_pools"):
        co.submit([0], [0], [0])
    k, v, _ = _pools(0)
    with pytest.raises(errors.InvalidArgumentError, match="KV heads"):
        co.register_pools([torch.zeros(ROWS, 3, B, D)] * LAYERS, [torch.zeros(ROWS, 3, B, D)] * LAYERS)
    with pytest.raises(errors.ShapeError, match="contiguous"):
        co.register_pools([t.transpose(2, 3) for t in k], v)
    with pytest.raises(errors.DTypeError, match="scales go with fp8"):
        co.register_pools(k, v, [torch.zeros(ROWS, HEADS)] * LAYERS, [torch.zeros(ROWS, HEADS)] * LAYERS)
    co.register_pools(k, v)
    with pytest.raises(errors.InvalidArgumentError, match="head 5"):
        co.submit([0], [0], [5])
    with pytest.raises(errors.InvalidArgumentError, match="equal length"):
        co.submit([0, 1], [0], [0])
    with pytest.raises(errors.InvalidArgumentError, match="layer 3"):
        co.wait_layer(3)
    with pytest.raises(errors.ConfigError, match="connections"):
        Coordinator("oasis-rt://127.0.0.1:9", LAYERS, HEADS, connections=0)
    with pytest.raises(errors.ConfigError, match="timeout_s"):
        Coordinator("oasis-rt://127.0.0.1:9", LAYERS, HEADS, timeout_s=0)
    co.close()
