"""The `dropless` command line: one module per subcommand, imported when used."""
