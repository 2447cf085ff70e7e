"""Helpers below every layer: standard library only."""
