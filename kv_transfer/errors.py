"""The one error type of the KV data plane.

Every failure that reaches a caller of ``kv_transfer`` is a ``KVTransferError``. Its ``retriable``
flag tells the control plane what to do: ``True`` means the request may succeed on another
prefill/decode pair or after the peer is re-added (a dead or restarted peer, a timed-out write);
``False`` means retrying the same thing fails the same way (incompatible layouts, block ids out of
range, a programming error).
"""

from __future__ import annotations


class KVTransferError(RuntimeError):
    def __init__(self, message: str, *, retriable: bool, peer: str | None = None) -> None:
        super().__init__(message)
        self.retriable = retriable
        self.peer = peer

    def __reduce__(self):  # keep the flags when pickled (multiprocessing, Ray)
        return (_rebuild, (type(self), str(self), self.retriable, self.peer))


def _rebuild(cls: type[KVTransferError], message: str, retriable: bool,
             peer: str | None) -> KVTransferError:
    err = cls.__new__(cls)
    RuntimeError.__init__(err, message)
    err.retriable, err.peer = retriable, peer
    return err
