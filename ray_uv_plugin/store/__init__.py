"""The venv dir, as every role reads and writes it: layout and names, the ready marker, trust
in its paths, the build lock, disk usage, and what it holds and how a venv leaves it (the
inventory, the processes that use venvs, the safe removal, gc), which a build uses too when it
makes room within the venv dir's budget. Imports nothing else of the package."""
