"""The `pagedserve` command line: one module per subcommand (see `pagedserve.cli.main`)."""
