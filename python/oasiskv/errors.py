"""The OasisKV exception hierarchy.

Every error the library raises on purpose is an :class:`OasisError`. Caller mistakes also derive
from the matching built-in (``ValueError``, ``TypeError``, ...) so ``except ValueError`` keeps
working. Messages say what was wrong and how to fix the call. The native module maps each Rust
error variant onto one of these classes.
"""

from __future__ import annotations


class OasisError(Exception):
    """Base class of every error OasisKV raises on purpose."""


class ConfigError(OasisError, ValueError):
    """A configuration value is invalid (KvConfig, model config, CLI flags)."""


class ShapeError(OasisError, ValueError):
    """A tensor has the wrong shape for the operation."""


class DTypeError(OasisError, TypeError):
    """A tensor has a dtype the operation does not support."""


class DeviceError(OasisError, ValueError):
    """A tensor lives on the wrong device, or the devices of the arguments disagree."""


class InvalidArgumentError(OasisError, ValueError):
    """Arguments are inconsistent with each other (e.g. a fetch cap of zero, aliasing outputs)."""


class IndexError_(OasisError, IndexError):
    """A table entry (page id, block id, slot) points outside the buffer it indexes."""


class OutOfBlocksError(OasisError, MemoryError):
    """A pool (GPU pages or host blocks) has fewer free blocks than requested."""


class OutOfMemoryError(OasisError, MemoryError):
    """What was asked for (a model's weights, the KV pools) would not fit in the device's free memory.

    Raised before allocating, from an estimate (:mod:`oasiskv.memory`), so the process never gets as
    far as a raw allocator error or the OOM killer.
    """


class ContextLengthError(OasisError, ValueError):
    """A prompt plus the requested new tokens exceeds the model's context window."""


class InvalidTextError(ConfigError):
    """Text to encode is not valid Unicode: it holds a lone UTF-16 surrogate (U+D800..U+DFFF),
    e.g. from a JSON ``"\\ud800"`` escape or ``bytes.decode(errors="surrogateescape")``, which
    has no UTF-8 encoding and so no tokens. A :class:`ConfigError` (hence a ``ValueError``).

    ``index`` is the character's position in the text, ``char`` the surrogate itself.
    """

    def __init__(self, message: str, index: int, char: str) -> None:
        super().__init__(message)
        self.index = index
        self.char = char


class CheckpointError(OasisError, OSError):
    """A checkpoint is missing, incomplete or corrupt."""


class UnsupportedQuantizationError(CheckpointError):
    """A GGUF tensor uses a quantisation type the loader does not support."""


class CudaUnavailableError(OasisError, RuntimeError):
    """A GPU path was requested but the CUDA driver, NVRTC or a supported GPU is missing."""


class TensorParallelError(OasisError, RuntimeError):
    """A tensor-parallel group (:mod:`oasiskv.parallel`) cannot go on: a collective failed because
    a rank died or did not answer within the group's timeout. Fatal for the group: every later
    collective of this rank raises it again."""


class RankFailedError(TensorParallelError):
    """A rank process of :func:`oasiskv.parallel.run_tp` died or raised.

    ``rank`` is the first rank that failed, ``exitcode`` its process's exit code (``None`` while
    it was still running), ``errors`` maps every rank that raised to its traceback text (the
    others' view of the failure: a rank that died reports nothing).
    """

    def __init__(self, message: str, rank: int, exitcode: int | None = None, errors: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.errors = dict(errors or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank, self.exitcode, self.errors))


class RemoteError(OasisError):
    """The KV staging daemon (``oasis-rt``) refused a call, or talking to it failed.

    ``code`` is the protocol's error name (``"busy"``, ``"unknown_request"``, ``"unauthorized"``,
    ...) or, for a failure on this side of the wire, ``"unreachable"``, ``"closed"`` or
    ``"timeout"``; the subclasses group what a caller does about it.
    """

    code: str = "internal"


class RemoteUnavailableError(RemoteError, ConnectionError):
    """The daemon cannot be reached, or closed the connection (it exited or was killed). The
    client is unusable afterwards: make a new one once the daemon is back."""


class RemoteTimeoutError(RemoteError, TimeoutError):
    """The daemon did not answer within the client's ``timeout_s``. The client is closed."""


class RemoteAuthError(RemoteError, PermissionError):
    """The daemon refused the handshake: missing or wrong token (its ``--token-file``)."""


class RemoteBusyError(RemoteError, MemoryError):
    """The daemon's staging memory (``--memory``) cannot take the staging now (``busy``: live
    data fills it, retry after releases) or ever (``out_of_memory``)."""


class RemoteNotFoundError(RemoteError, LookupError):
    """The daemon holds no such request or block: never staged, released, or evicted after its
    lease."""


__all__ = [
    "OasisError",
    "ConfigError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "InvalidArgumentError",
    "IndexError_",
    "OutOfBlocksError",
    "OutOfMemoryError",
    "ContextLengthError",
    "InvalidTextError",
    "CheckpointError",
    "UnsupportedQuantizationError",
    "CudaUnavailableError",
    "TensorParallelError",
    "RankFailedError",
    "RemoteError",
    "RemoteUnavailableError",
    "RemoteTimeoutError",
    "RemoteAuthError",
    "RemoteBusyError",
    "RemoteNotFoundError",
]
