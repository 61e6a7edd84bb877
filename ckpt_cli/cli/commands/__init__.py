"""One module per subcommand; each registers itself on `ckpt_cli.cli.app.app` when imported."""
