"""``dlmix plan``: from a chip inventory, a model, an SLO and a workload to a recommended deployment (docs/plan.md).

Inventory: :mod:`dlmix.plan.inventory`; workload sample: :mod:`dlmix.plan.workload`; analytic pruning:
:mod:`dlmix.plan.analytic`; search with the simulator: :mod:`dlmix.plan.search`; baselines:
:mod:`dlmix.plan.baselines`; outputs: :mod:`dlmix.plan.report`.
"""
from dlmix.plan.analytic import SLO  # noqa: F401
from dlmix.plan.inventory import Inventory, InventoryError, load_inventory  # noqa: F401
from dlmix.plan.search import Candidate, Planner, PlanResult  # noqa: F401
from dlmix.plan.workload import PlanWorkload, load_plan_workload  # noqa: F401
