"""The worker process: one engine behind the prefill and/or decode gRPC servicers, its KV
endpoint, heartbeats to the router and Prometheus metrics (``kvrelay worker``)."""
