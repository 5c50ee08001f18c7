"""``python -m dlmix ...``: the ``dlmix`` command (:func:`dlmix.cli.main`)."""
from dlmix.cli import main

if __name__ == "__main__":
    main()
