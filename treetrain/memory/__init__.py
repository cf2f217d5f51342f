"""Memory by lifetime: measurement (tracker), prediction (calibrate, ledger), control (retention, planner).

Only the dependency-free pieces are imported here, so the engine can use `ClassBytes` without a cycle;
import the rest from their modules (`treetrain.memory.ledger`, `.retention`, `.planner`, ...).
"""

from treetrain.memory.classes import CLASSES, ClassBytes, LifetimeClass

__all__ = ["CLASSES", "ClassBytes", "LifetimeClass"]
