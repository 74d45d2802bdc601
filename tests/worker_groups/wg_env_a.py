"""A worker whose module needs `tabulate`: importable only in uv environment A."""

import tabulate
from wg_probe import probe


class TabulateWorker:
    def whoami(self) -> dict:
        return {**probe(), "table": tabulate.tabulate([[1, 2]], tablefmt="plain")}
