"""Stdlib "model" runners, one per track, written into task workspaces as `runner.py`."""
