"""The rollout service."""
