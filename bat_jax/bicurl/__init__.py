"""BiCuRL, the bilevel curriculum RL outer loop: `run(cfg, workdir)` (see `loop`).

Modules: `loop` (the outer loop), `setup` (tokenizer, model, SFT examples), `bank` (the Stage
Bank process), `policy` (serving and evaluating the policy), `grpo_round` (one round of GRPO),
`state` (durable outer-loop state, run-directory layout), `report` (report.json / .md, plots).
"""

from bat_jax.bicurl.loop import params_digest, run
from bat_jax.bicurl.state import OuterState, RoundRecord, RunPaths

__all__ = ["OuterState", "RoundRecord", "RunPaths", "params_digest", "run"]
