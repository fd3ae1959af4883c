"""``python -m moeref``: the same command as ``moeref`` (:mod:`moeref.cli`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
