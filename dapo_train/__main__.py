"""`python -m dapo_train` is the `dapo-train` command."""

from dapo_train.cli import main

main()
