"""The ``moe-dist`` subcommands, one module each (named in :data:`moe_dist.cli.COMMANDS`), and
:mod:`~moe_dist.commands.common`, their shared argument and error helpers. A command module parses
its arguments and calls into the library; no library module imports from here."""
