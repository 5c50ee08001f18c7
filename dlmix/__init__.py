"""dlmix: heterogeneous LLM serving (KV layout and transfer, placement, PD orchestration)."""
__version__ = "0.1.0"
