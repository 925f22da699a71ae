"""The version of ringattn: the one place it is written (setuptools reads it
for the package metadata; ``ringattn.__version__`` and ``ringattn
--version`` show it)."""

__version__ = "0.1.0"
