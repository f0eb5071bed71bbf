"""rngcoord server: the coordinator, its storage backends, the audit chain and the CLI."""
