"""Generated from protos/libra/v1 by scripts/gen_protos.py. Do not edit."""
