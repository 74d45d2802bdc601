"""Driving a running cluster from one process: connecting to it (`connect`, `auth`), preparing
an env on its nodes (`prepare`: a probe per node, shipping the venv), watching for nodes that
join (`watch`), and the probe that runs inside a venv (`probe`). Used by the operator's CLI
(`ops`) and by `worker_groups`; imports `store`, `agent` and `ship`."""
