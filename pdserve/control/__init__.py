"""The control plane: the controller actor (replicas' lives) and the `pdserve up/down/status` commands that drive it."""
