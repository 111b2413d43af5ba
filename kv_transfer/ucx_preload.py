"""Imported by a fork server before it forks processes that make NIXL agents (the loopback
harness's, ``kvrelay.fork_preload``; a TP replica's rank server, ``NixlConnector``): UCX loaded
and its clock calibrated once, not in every fork (``nixl_transport.preload_ucx``)."""

from kvrelay.kv_transfer.nixl_transport import preload_ucx

preload_ucx()
