"""The soak: a 1P1D cluster under a steady mixed load, memory and KV blocks watched."""
