"""The ``gpuwarden`` command: one entry point, a subcommand per part."""
