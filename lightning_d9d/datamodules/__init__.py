"""The Lightning-facing layer: the DataModules (the only stage that imports Lightning, with the CLI)."""
