"""A tiny ledger of amounts in cents."""
