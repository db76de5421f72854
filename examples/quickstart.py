"""Placeholder until the quickstart lands in this commit series."""
