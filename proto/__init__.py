"""Protocol buffers of kvrelay.v1 and their committed generated stubs."""
