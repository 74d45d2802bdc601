"""The driver variables that are credentials Ray reads: a worker group never copies them.

A group copies the driver's environment into every worker's and initializer's runtime_env
(`worker_env.driver_env_vars`), and a runtime_env is not a secret store: Ray shows it in plain text
(`ray list actors --detail`, the dashboard) and the runtime-env agent of every node writes it to
`runtime_env_agent.log`. KubeRay gives every Ray container of a token-auth cluster the token in
`RAY_AUTH_TOKEN`, so a job driven from the head holds it. A worker needs none of these from the
driver: it talks to its own node's raylet, and inherits that raylet's environment (the node's
token, TLS files and mode), which is the one that matches the node. A variable that a worker does
need, set on purpose, goes in the group's ``env_vars``.
"""

from __future__ import annotations

# Each with why Ray reads it (Ray 2.60: `ray._private.authentication`, `ray._private.tls_utils`,
# the Jobs CLI, the dashboard's Prometheus client, the runtime_env HTTP downloader, the KubeRay
# autoscaler). Any name under one of the prefixes is left out too, those of later Rays included.
RAY_CREDENTIAL_VARS: dict[str, str] = {
    "RAY_AUTH_TOKEN": "the cluster's token itself (token authentication)",
    "RAY_AUTH_TOKEN_PATH": "the file a process reads the token from instead",
    "RAY_AUTH_MODE": "token or disabled: the node decides; a worker unlike its raylet is refused",
    "RAY_ENABLE_K8S_TOKEN_AUTH": "Kubernetes checks the tokens (KubeRay's option): likewise",
    "RAY_USE_TLS": "gRPC TLS on or off, which the node decides as it does the auth mode",
    "RAY_TLS_SERVER_KEY": "the private key of the node's gRPC TLS certificate",
    "RAY_TLS_SERVER_CERT": "that certificate",
    "RAY_TLS_CA_CERT": "the CA that gRPC peers are checked against",
    "RAY_REDIS_PASSWORD": "the password of an external Redis that holds the GCS's state",
    "RAY_REDIS_ADDRESS": "that Redis's address, whose URL may hold the password",
    "RAY_REDIS_CLIENT_KEY": "the private key for TLS to that Redis",
    "REDIS_PASSWORD": "the Redis password KubeRay's GCS fault tolerance hands to `ray start`",
    "RAY_JOB_HEADERS": "HTTP headers of the `ray job` CLI: an Authorization header, mostly",
    "RAY_PROMETHEUS_HEADERS": "HTTP headers for the dashboard's Prometheus: likewise",
    "RAY_RUNTIME_ENV_BEARER_TOKEN": "the bearer token for runtime_env packages from a URL",
    "RAY_KUBERAY_CLIENT_KEY_PATH": "the KubeRay autoscaler's client TLS key",
    "RAY_KUBERAY_CLIENT_CERT_PATH": "its certificate",
    "RAY_KUBERAY_CA_CERT_PATH": "the CA it checks the Kubernetes API server against",
    "RAY_SANDBOX_API_TOKEN": "the token of Ray's experimental sandbox API",
}
RAY_CREDENTIAL_PREFIXES = ("RAY_AUTH_", "RAY_TLS_", "RAY_REDIS_")


def is_ray_credential(name: str) -> bool:
    """Whether `name` is a credential Ray reads, or its mode, path or TLS setting."""
    return name in RAY_CREDENTIAL_VARS or name.startswith(RAY_CREDENTIAL_PREFIXES)
