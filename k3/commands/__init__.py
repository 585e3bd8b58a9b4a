"""The `k3` commands, one module each (see k3.cli.COMMANDS): their arguments and their
run function, as thin layers over k3.engine and the library modules."""
