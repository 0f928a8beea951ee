"""The Stage Bank: a separate data process that writes leak-checked, three-pool round shards.

Modules: `grid` (126 abstract states), `rounds` (round views), `rl_rows` (reset-point rows),
`sft_rows` (cold-start rows), `task_source` (the `bat_jax.train_tasks` adapter; rebuilding a row's
workspace), `leakcheck` (fail-closed pre-check), `shards` (ArrayRecord + manifest, atomic
publish), `build` (one round end to end), `reader` (grain batches, resumable), `serve` (the
process and the outer loop's client). The bank never imports `bat_jax.evaluator`; held-out
content reaches it only as hashed markers (`bat_jax.markers`).
"""
