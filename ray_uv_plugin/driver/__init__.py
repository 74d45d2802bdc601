"""What runs in the driver's process: Ray's runtime_env hook for a driver started with `uv run`
(`hook`), the reading of that command line (`uv_run`), and finding the project it names
(`project_discovery`). Imports `store`, `agent` and the package's `registration`; nothing of
shipping, the cluster or the CLI."""
