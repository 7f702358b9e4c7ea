"""Merging integer intervals."""
