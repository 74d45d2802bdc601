"""What runs inside Ray's runtime-env agent on every node, on every request: the plugin glue,
the `uv_project` value, the project's files, the request and its key, uv and its environment,
the build, remembered failed builds, and the checks of Ray's library extras. Small, fast and
safe; imports `store` and nothing above it."""
