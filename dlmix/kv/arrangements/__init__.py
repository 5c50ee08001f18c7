"""Built-in KV cache arrangements, one file per engine family; importing this package registers them.

Each module defines :class:`~dlmix.kv.registry.Arrangement` subclasses decorated with
:func:`~dlmix.kv.registry.register`; see :mod:`dlmix.kv.registry` for how to add one (a file here, or a
``dlmix.kv_arrangements`` entry point in another distribution).
"""

from . import lmdeploy, mla, sglang, vllm_cpu, vllm_flash, vllm_flashinfer, vllm_unified  # noqa: F401
