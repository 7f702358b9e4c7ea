"""The five Libra services, one folder each; installed as `libra.services`."""
