"""Tree sources: where a training run's trees come from, behind one protocol (`tree_source.TreeSource`).

The synchronous (`sync_source`), asynchronous (`async_source`, with its on-disk queue `tree_queue` and the
staleness bound it keeps, `staleness`) and recorded (`recorded_source`) sources; what they read of a run
(`run_settings`), the one place its settings become the engine's, the token wrapper's and the rollout's
(`engine_config`), the checks of those settings before torch loads (`start_checks`), the collectives that
share an update's trees across ranks (`shared_trees`) and what an update does with tasks its environment
failed (`env_failures`). Nothing here imports the trainer: it hands its settings and backend over through
the protocols of `run_settings`.
"""
