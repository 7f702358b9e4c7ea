"""The planner service."""
