"""The entry points above the parts: the `batchgate` command and the supervisor of `batchgate up`.

This package imports the gateway and the worker (lazily, per subcommand); `shared/` imports neither.
"""
