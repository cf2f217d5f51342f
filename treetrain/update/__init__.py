"""One update: advantages → manifest and batch → plan → window → replay → coverage → step → version.

`treetrain.update.run.run_update` is the update, top to bottom; read it first. `plan_for`
(`treetrain.update.planning`) turns the run's settings into the update's one `Plan`, `open_window`
(`treetrain.update.window`) makes the frozen `UpdateWindow`, `replay_window` (`treetrain.update.faults`)
replays it under the one failure policy, and a `Learner` (`treetrain.update.learner`) is what a rank keeps
from one update to the next; `treetrain.update.settings` holds the settings the update reads. Import from
those modules: this package imports nothing, so reading the config does not load the replayer.
"""
