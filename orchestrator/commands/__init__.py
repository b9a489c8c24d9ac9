"""CLI subcommands. Each module defines ``add_parser(subparsers)`` which registers its parser and sets
``func`` (args -> exit code). Add a command by adding its module name to ``COMMANDS``."""
COMMANDS = ("run", "report", "validate", "refine", "store", "export", "models", "bundle", "doctor")
