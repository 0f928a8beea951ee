"""Stdlib-only code the expert solver ships into workspaces; the rubric imports the same code.

These files run INSIDE sandbox workspaces on a bare system python, so they stay self-contained
(their own atomic write, hashing); package code uses `bat_jax.io_utils` instead. Their text is
part of the expert's actions (and so of SFT targets): edit it only on purpose.
"""
