"""Moving policy weights from the trainer to the rollout engines: the `weights:` config section
(config.py), layout, flat buffers, the weights group (group.py, sender, receivers) and its
roster. Shared by the trainer (services/trainer/publisher.py) and the rollout gateway
(services/rollout/weight_delivery.py), which never import each other."""
