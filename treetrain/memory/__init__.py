"""Memory by lifetime: measurement (tracker), prediction (calibrate, ledger), control (retention, planner).

Import from the modules (`treetrain.memory.ledger`, `.retention`, `.planner`, ...). The shared unit, bytes
per lifetime class, is `treetrain.lifetime.ClassBytes`: it sits below both this package and the engine.
"""
