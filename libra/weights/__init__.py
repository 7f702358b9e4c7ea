"""Moving policy weights from the trainer to the rollout engines: layout, flat buffers, the
weights group (sender, receivers, roster). Shared by the trainer and rollout services."""
