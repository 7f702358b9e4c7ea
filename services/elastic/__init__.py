"""The elastic service."""
