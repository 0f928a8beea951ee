"""Stdlib-only code the expert solver ships into workspaces; the rubric imports the same code."""
