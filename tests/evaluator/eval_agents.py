"""Misbehaving agents for the robustness tests (module-level so worker processes can import
them): what each does depends on the cell's track."""

import os
import time

from bat_jax.evaluator.agents import Turn

# track -> behaviour
BEHAVIOUR = {"classification": "exit", "vqa": "hang", "report": "not_a_turn",
             "detection": "raise", "segmentation": "malformed"}


class MisbehavingAgent:
  def __init__(self, instance):
    self.behaviour = BEHAVIOUR.get(instance.track, "stop")

  def __call__(self, messages):
    if self.behaviour == "exit":
      os._exit(3)  # the worker process dies mid-cell
    if self.behaviour == "hang":
      time.sleep(600)
    if self.behaviour == "not_a_turn":
      return "execute_code(python, print(1))"  # an adapter that returns unparsed text
    if self.behaviour == "raise":
      raise RuntimeError("engine connection reset")
    if self.behaviour == "malformed" and len(messages) < 4:
      return Turn((), error="unparseable tool call")  # the policy's fault: a valid cell
    return Turn(())
