import json

import pytest

from bat_jax import workflow
from bat_jax.evaluator.firewall import REPORT_SCHEMA


@pytest.fixture
def good_report():
  """A well-formed aggregate report (values made up; the firewall only checks the form)."""
  stages = {s: 0.5 for s in workflow.STAGES}
  return json.loads(json.dumps({
      "schema": REPORT_SCHEMA, "tier": "lite", "stage_scores": stages, "task_score": 0.4,
      "agentic": 0.5, "overall": 0.45,
      "track_scores": {"vqa": {"overall": 0.45, "task": 0.4, "agentic": 0.5,
                               "stage_scores": stages, "cells": 3, "valid": 3}},
      "completion": {"cells": 3, "valid": 3, "submitted": 2, "agent_stopped": 3,
                     "stage_evidence": {s: 3 for s in workflow.STAGES}},
      "failure_categories": {"no_submission": 1},
      "validity": {"valid": True, "valid_cells": 3, "invalid_cells": 0},
      "protocol_digest": "a" * 64, "cell_set_digest": "b" * 64}))
