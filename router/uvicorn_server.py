"""Starting a uvicorn server on the router's own event loop (the public HTTP API and the scrape
port): no signal handlers of its own, bind errors raised, the port it bound returned."""

from __future__ import annotations

import asyncio
import time

import uvicorn

START_TIMEOUT_S = 10.0


async def start_server(config: uvicorn.Config,
                       what: str) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    """Serve ``config`` as a task of the running loop; returns the server, its task and the port
    it bound (``config.port`` 0: the one the OS picked). ``what`` names it in errors."""
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.get_running_loop().create_task(server.serve())
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if task.done():
            task.result()  # raises the bind error
            raise OSError(f"{what} on {config.host}:{config.port} did not start")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start within {START_TIMEOUT_S:g}s")
        await asyncio.sleep(0.01)
    return server, task, server.servers[0].sockets[0].getsockname()[1]
