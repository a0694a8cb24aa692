"""``python -m specdec``: the ``specdec`` command line (see :mod:`specdec.cli`)."""

from specdec.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
