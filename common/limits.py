"""Bounds on what one client request may carry, shared by the HTTP and gRPC edges.

Each bound either matches the wire type that carries the value to the workers (a value past
it would overflow a protobuf field) or keeps what a request can cost the router in proportion
to what a valid one needs.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1

# A client's request id (HTTP/gRPC edge); the router extends it with an attempt suffix for the
# workers, which therefore accept ids up to twice as long.
MAX_REQUEST_ID = 128
MAX_ATTEMPT_ID = 2 * MAX_REQUEST_ID
MAX_PROMPT_CHARS = 4 * 2**20  # a text prompt, or all chat messages together
# Messages of one chat request: agent traces run to hundreds or a few thousand; rendering the
# template costs per message even when each is empty (200,000 empty messages took 5.2 s).
MAX_CHAT_MESSAGES = 8192
# Prompt tokens of a request that asks for prompt logprobs: each returns up to 21 logprobs, and
# the engine computes a full-vocabulary row of logits for each (in chunks).
MAX_PROMPT_LOGPROB_TOKENS = 8192
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_TIMEOUT_MS = 3_600_000
# The largest valid HTTP body: a prompt of MAX_PROMPT_CHARS characters, each JSON-escaped to at
# most 6 bytes (\uXXXX), plus the rest of the request.
MAX_HTTP_BODY_BYTES = 6 * MAX_PROMPT_CHARS + 2**20
# The largest valid GenerateRequest: the same prompt in UTF-8 (at most 4 bytes a character),
# plus the rest. Token-id prompts are bounded by the context, far below this.
MAX_GRPC_REQUEST_BYTES = 4 * MAX_PROMPT_CHARS + 2**20
