"""Reproducers: one folder per miss, missing op or failing kernel, each with a standalone repro.py."""
