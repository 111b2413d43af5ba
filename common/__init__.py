"""Helpers every process shares: command-line options, RPC plumbing (channels, TLS, trailing
metadata markers), protobuf <-> engine conversion, request bounds, logging and timeline marks.
Nothing here imports a process's package (router, workers, deploy)."""
