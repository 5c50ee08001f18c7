"""Chip profiles (catalog in ``dlmix/data/chips.yaml``) and the PD cost model (:mod:`dlmix.hw.cost`)."""
from dlmix.hw.profiles import ChipProfile, LinkProfile, Catalog, load_catalog  # noqa: F401
from dlmix.hw.cost import ModelSpec, CostModel, ewma_ratio  # noqa: F401
