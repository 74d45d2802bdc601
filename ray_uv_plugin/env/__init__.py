"""The requested env, as a value: the `uv_project` field table and its parsed value, the
project on disk, the key, and uv with the environment it runs in. Used by every role (the agent,
the driver hook, `prepare`, the ship, `ray-uv check`), never importing Ray at module level."""
