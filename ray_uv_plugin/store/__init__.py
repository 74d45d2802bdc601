"""The venv dir, as every role reads and writes it: layout and names, the ready marker, trust
in its paths, the build lock and disk usage. Imports nothing else of the package."""
