"""A deterministic task source for bank tests that must not depend on the task families.

The bank takes its source by injection (`TaskSource`); this one writes a plain brief per
(track, outcome, seed). Tests that exercise the real `bat_jax.train_tasks` source live beside it.
"""

import hashlib

from bat_jax.stagebank.rl_rows import TaskDescription


class SyntheticSource:
  name = "tests.synthetic"

  def describe(self, track: str, outcome: str, seed: int, focus: str) -> TaskDescription:
    brief = (f"A {track} study workspace holds input cases under data/ and a model under "
             f"models/. Produce the {track} outputs described in task/spec.json (variant {seed}). "
             f"Do {focus} only.")
    return TaskDescription(generator=f"{self.name}/{track}", task_id=f"train-{track}-{seed}",
                           brief=brief,
                           workspace_sha256=hashlib.sha256(brief.encode()).hexdigest())
