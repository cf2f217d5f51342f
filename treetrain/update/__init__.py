"""One update: advantages → manifest and batch → plan → placement → replay → coverage → step → version.

`treetrain.update.run.run_update` is the update, top to bottom; read it first. `UpdateWindow`
(`treetrain.update.window`) is the exactly-once window it drives, `plan_for` (`treetrain.update.planning`)
turns the run's settings into the planner's decision, and `treetrain.update.settings` holds the `replay`
config section the update consumes. Import from those modules: this package imports nothing, so reading
the config does not load the engine.
"""
