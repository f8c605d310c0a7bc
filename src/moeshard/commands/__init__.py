"""One module per ``moeshard`` subcommand (see ``moeshard.cli``)."""
