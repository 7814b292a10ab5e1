"""Checks a contributor runs on a change or on a machine (docs/contributing.md)."""
