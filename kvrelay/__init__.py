"""kvrelay: disaggregated prefill/decode LLM serving.

The repository's top-level folders are imported under this namespace (see pyproject.toml):
``kvrelay.engine``, ``kvrelay.kv_transfer``, ``kvrelay.prefill_worker``, ``kvrelay.decode_worker``,
``kvrelay.router``, ``kvrelay.proto`` and ``kvrelay.deploy``.
"""

__version__ = "0.1.0"
