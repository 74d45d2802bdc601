"""A worker whose module needs `termcolor`: importable only in uv environment B."""

import termcolor
from wg_probe import probe


class TermcolorWorker:
    def whoami(self) -> dict:
        return {**probe(), "colored": termcolor.colored("x", "red")}
