"""Developer tools: test checkpoints, default-model preparation and process launchers (never imported by a service)."""
