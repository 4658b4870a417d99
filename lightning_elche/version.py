"""The package's version, in a module of its own: any module may read it without importing the
package root (which imports the strategy and the monitor). ``pyproject.toml`` reads it from here."""

__version__ = "0.1.0"
