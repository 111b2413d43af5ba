"""Admission before work: what a request may cost the router before it is routed.

Between its arrival and its spec (body read, JSON parsed, validated, tokenized, grammar
checked) a request costs the router memory in proportion to its body and CPU on the event loop
or the tokenizer threads, before the in-flight cap (``RouterService.generate``) ever counts it.
``Admission`` bounds those requests by count and by body bytes, on arrival: a request that does
not fit is refused at once (HTTP 429 / RESOURCE_EXHAUSTED, with a retry hint) instead of
queueing work the router cannot keep up with. Small requests fit beside a few maximal bodies:
the byte budget holds two of the largest valid ones. With several API keys (``shared``) no key
holds more than its share of the places (``ceil(max_requests / keys present)``, and never the
last quarter), so one key's flood of bodies cannot keep another's request from being read.

Loop-confined (the router's event loop): no locks.
"""

from __future__ import annotations

import math

from kvrelay.common.limits import MAX_HTTP_BODY_BYTES

# Requests being read, parsed and tokenized at once. Each costs well under a millisecond when
# small; the tokenizer threads (two) bound how fast large ones can go anyway.
MAX_ADMITTING = 64
# Body bytes of those requests together: two maximal bodies. A parsed body costs up to ~15x
# its bytes in Python objects (a 25 MiB body of numbers: ~400 MiB), so this bounds the router's
# memory for requests in parse well under its 2 GiB limit.
MAX_ADMITTING_BYTES = 2 * MAX_HTTP_BODY_BYTES
RETRY_AFTER_S = 1.0


def concurrency_limit(max_inflight: int) -> int:
    """Requests (gRPC calls, HTTP connections) a public server serves at once, past which it
    refuses before reading anything: every request in flight, as many waiting for a slot or
    idle, and as many again being parsed. A backstop behind admission and the fair queue."""
    return 2 * max_inflight + MAX_ADMITTING


class Ticket:
    """One admitted request's share; ``release`` (idempotent) gives it back."""

    __slots__ = ("_admission", "nbytes", "released", "tenant")

    def __init__(self, admission: Admission, nbytes: int, tenant: str = ""):
        self._admission = admission
        self.nbytes = nbytes
        self.tenant = tenant
        self.released = False

    def grow(self, nbytes: int) -> bool:
        """Take ``nbytes`` more (a body of unknown length as it arrives); False when they do
        not fit, and the ticket keeps what it had."""
        a = self._admission
        if self.released or a.bytes + nbytes > a.max_bytes:
            return False
        a.bytes += nbytes
        self.nbytes += nbytes
        return True

    def release(self) -> None:
        if not self.released:
            self.released = True
            a = self._admission
            a.requests -= 1
            a.bytes -= self.nbytes
            left = a.by_tenant[self.tenant] - 1
            if left:
                a.by_tenant[self.tenant] = left
            else:
                del a.by_tenant[self.tenant]


class Admission:
    def __init__(self, max_requests: int = MAX_ADMITTING,
                 max_bytes: int = MAX_ADMITTING_BYTES, *, shared: bool = False):
        if max_requests < 1 or max_bytes < 1:
            raise ValueError("admission bounds must be positive")
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.shared = shared  # several tenants (API keys) may come: each gets its share
        self.requests = 0
        self.bytes = 0
        self.refused = 0
        self.by_tenant: dict[str, int] = {}  # tickets held per tenant

    def tenant_cap(self, tenant: str) -> int:
        """Places ``tenant`` may hold: all of them when one tenant is possible, else its share
        among the tenants present (itself included), never the last quarter."""
        if not self.shared:
            return self.max_requests
        present = len(self.by_tenant) + (tenant not in self.by_tenant)
        return max(1, min(self.max_requests - self.max_requests // 4,
                          math.ceil(self.max_requests / present)))

    def enter(self, nbytes: int = 0, tenant: str = "") -> Ticket | None:
        """A ticket for a request of ``tenant`` with ``nbytes`` body bytes, or None (counted
        in ``refused``) when the router already admits as many requests or bytes as it may,
        or that tenant holds its share of the places."""
        if self.requests >= self.max_requests or self.bytes + nbytes > self.max_bytes \
                or self.by_tenant.get(tenant, 0) >= self.tenant_cap(tenant):
            self.refused += 1
            return None
        self.requests += 1
        self.bytes += nbytes
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        return Ticket(self, nbytes, tenant)

    def busy_message(self, tenant: str = "") -> str:
        held = self.by_tenant.get(tenant, 0)
        if self.shared and held >= self.tenant_cap(tenant):
            return (f"router busy: {held} requests of this API key are being parsed and "
                    f"tokenized (its share of the router's {self.max_requests}); retry shortly")
        return (f"router busy: {self.requests} requests ({self.bytes} body bytes) are being "
                f"parsed and tokenized; retry shortly")
