"""Entry point only: `python -m bat_jax.serve` runs the HTTP model server, `bat_jax.rollout.server`."""
