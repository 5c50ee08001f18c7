"""dlmix adapter for vLLM (import name ``dlmix_vllm``; directory ``plugins/vllm``)."""


def register() -> None:
    """vLLM ``general_plugins`` entry point; filled in by the connector module."""
