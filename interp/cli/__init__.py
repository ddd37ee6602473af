"""The ``interp`` command line: :mod:`interp.cli.main` parses and dispatches; :mod:`interp.cli.common`
holds the command registry, argument types and checks; each other module registers one command group."""
